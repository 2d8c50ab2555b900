"""Kimi-K3's channel tokens, split by owner.

ASSUMED (no K3 template or encoder is available here; see README.md): every message part
is a channel ``<|open|>NAME<|sep|> … <|close|>NAME<|sep|>`` and a message ends with
``<|end_of_msg|>``. Channels: ``think`` (reasoning), ``response`` (the answer) and
``call`` (one tool call: ``NAME<|sep|>{json arguments}``).
"""

from __future__ import annotations

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


def opens(channel: str) -> str:
    return f"{OPEN}{channel}{SEP}"


def closes(channel: str) -> str:
    return f"{CLOSE}{channel}{SEP}"


# What the reasoning stage strips: the think channel's delimiters, and the response
# channel's opener, which also ends a think channel left unclosed.
REASONING_START = (opens("think"),)
REASONING_END = (closes("think"), opens("response"))

# What only the tool parser may touch: the call channel (the one region opener) and the
# response framing around every answer, which it drops.
CALL_OPEN, CALL_CLOSE = opens("call"), closes("call")
RESPONSE_FRAMING = (opens("response"), closes("response"), END_OF_MSG)
