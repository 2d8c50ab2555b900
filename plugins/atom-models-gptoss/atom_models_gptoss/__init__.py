"""gpt-oss models (GptOssForCausalLM) for ATOM."""
