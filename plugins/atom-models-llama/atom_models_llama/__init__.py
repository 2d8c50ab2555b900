"""Llama-family models (LlamaForCausalLM) for ATOM."""
