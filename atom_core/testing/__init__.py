"""Helpers for testing ATOM and its plugins, public so that a plugin's tests need only an
installed atom-core (no checkout of this repository).

- ``atom_core.testing.tiny_models``: tiny random checkpoints saved with transformers
  (``tiny_model_dir("qwen3")``) and their transformers models (``hf_model``);
- ``atom_core.testing.model_reference``: ``check_against_transformers(kind)``, a model's
  logits against transformers' over prefill, mixed and decode steps;
- ``atom_core.testing.engine_reference``: the whole engine against transformers (greedy
  tokens, prompt logprobs) under the settings every architecture must pass;
- ``atom_core.testing.paged_kv``: ``PagedKV`` and ``allocate_kv_caches``, the model
  runner's paging for tests that drive a model directly;
- ``atom_core.testing.op_cases``: inputs an op's reference tests and a kernel plugin's
  tests share (``qk_norm_rope_case``, ``expected_kv_cache``, ``moe_checkpoint``).

Importing this package imports none of them: each loads torch, and some transformers.
"""
