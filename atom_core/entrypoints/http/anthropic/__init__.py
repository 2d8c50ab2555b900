"""Anthropic's Messages API (POST /v1/messages)."""
