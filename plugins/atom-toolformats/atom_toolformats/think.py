"""The inline ``<think>…</think>`` reasoning dialect (Qwen3, GLM, DeepSeek, MiniMax,
Kimi-K2-Thinking).

Templates that open the block in their generation prompt (DeepSeek-R1's ends with
``<think>\\n``) make the output begin inside it; that is read per request from the prompt.
"""

from __future__ import annotations

from atom_core.parsing import ReasoningDialect


class ThinkDialect(ReasoningDialect):
    name = "think"
    START_MARKERS = ("<think>",)
    END_MARKERS = ("</think>",)
    TEMPLATE_SIGNATURE = ("<think>", "</think>")
