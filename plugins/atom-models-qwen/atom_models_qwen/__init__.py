"""Qwen3 models (Qwen3ForCausalLM) for ATOM."""
