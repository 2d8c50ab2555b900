"""OpenAI's APIs: /v1/chat/completions and /v1/completions."""
