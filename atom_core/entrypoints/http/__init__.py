"""The HTTP server: the app (``app``), what every route shares (errors, OpenAPI, body
parsing, field checks, prompt tokenizing, SSE, admission, guards, request ids, metrics),
and one package per API: ``openai`` (/v1/chat/completions, /v1/completions) and
``anthropic`` (/v1/messages)."""
