"""POST /tokenize and /detokenize, in vLLM's request and response shapes.

/tokenize takes a completion prompt, ``{"prompt": TEXT, "add_special_tokens": true}``, or
chat messages, ``{"messages": [...], "add_generation_prompt": true, "add_special_tokens":
false}`` with the ``continue_final_message``, ``tools``, ``chat_template_kwargs`` and
thinking switches of /v1/chat/completions; ``return_token_strs`` adds each token's string.
It answers ``{count, max_model_len, tokens, token_strs}``. The chat form renders through
``OpenAIServingChat.render``, the path /v1/chat/completions takes, so its count is that
request's ``usage.prompt_tokens``; the completion form encodes as /v1/completions does.
A prompt past the context is counted, not refused, as vLLM counts it: a client asks to
learn whether its prompt fits (--max-request-body-bytes bounds the work).

/detokenize takes ``{"tokens": [...]}`` and answers ``{"prompt": TEXT}``; an id outside
the model's vocabulary is a 400, as it is in a prompt. ``info`` is the tokenizer's entry
in the /v1/models card, the rest of what a client needs to build prompts with it.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
from pydantic import Field, model_validator
from starlette.responses import Response

from atom_core.entrypoints.http.fields import TokenId, check_unicode
from atom_core.entrypoints.http.generation import check_model
from atom_core.entrypoints.http.openai.chat import OpenAIServingChat
from atom_core.entrypoints.http.openai.protocol import (
    ChatMessage,
    OpenAIRequest,
    ThinkingSwitch,
    TokenizerInfo,
    ToolDict,
)
from atom_core.entrypoints.http.prompt_tokens import off_loop
from atom_core.entrypoints.http.sse import json_response
from atom_core.errors import InvalidRequestError
from atom_core.parsing.chat_encoders import PythonChatEncoder

# Counting is not bounded by the context: a length no prompt reaches.
UNBOUNDED = sys.maxsize
# vLLM's chat-form fields this server does not implement; each would change the prompt,
# so a value that asks for something is a 400 rather than a count of another prompt.
UNSUPPORTED_CHAT = ("chat_template",)

# ---------------------------------------------------------------------------- requests


class _TokenizerRequest(OpenAIRequest):
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return check_unicode(cls.__name__, data)


class TokenizeCompletionRequest(_TokenizerRequest):
    """/tokenize with a ``prompt``: its ids as /v1/completions would send them."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_TokenizerRequest):
    """/tokenize with ``messages``: the chat template's prompt, rendered as
    /v1/chat/completions renders it."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes them
    return_token_strs: bool = False
    tools: list[ToolDict] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    thinking: bool | ThinkingSwitch | None = None

    @property
    def thinking_requested(self) -> bool | None:
        """As ChatCompletionRequest reads its thinking switches."""
        if isinstance(self.thinking, ThinkingSwitch):
            return self.thinking.type == "enabled"
        if self.thinking is not None:
            return self.thinking
        return self.enable_thinking


class DetokenizeRequest(_TokenizerRequest):
    tokens: list[TokenId]


def tokenize_request(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as the form it is: ``messages`` makes it the chat form. Chosen by key,
    so a malformed request's errors are those of its own form (a union would report the
    other form's missing field first)."""
    if "messages" in body:
        return TokenizeChatRequest.model_validate(body)
    return TokenizeCompletionRequest.model_validate(body)


# --------------------------------------------------------------------------- responses


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only with return_token_strs


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


# --------------------------------------------------------------------------- handler


class ServingTokenization:
    """/tokenize and /detokenize over ``chat``'s engine, renderer and prompt tokenizer."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.engine = chat.engine

    async def tokenize(self, body: dict[str, Any]) -> Response:
        request = tokenize_request(body)
        check_model(request.model, self.chat.names)
        tokenizer = self._tokenizer()
        if isinstance(request, TokenizeChatRequest):
            extra = request.model_extra or {}
            for name in UNSUPPORTED_CHAT:
                if extra.get(name):
                    raise InvalidRequestError(
                        f"{name} is not supported by this server; leave it out", param=name
                    )
            text, ids, _ = await self.chat.render(request, max_len=UNBOUNDED)
            if request.add_special_tokens:  # on top of those the template wrote, as vLLM does
                ids = await off_loop(self._encode, text, True, "messages")
        else:
            ids = await off_loop(self._encode, request.prompt, request.add_special_tokens,
                                 "prompt")
        strs = None
        if request.return_token_strs:
            strs = await off_loop(tokenizer.convert_ids_to_tokens, ids)
        return json_response(TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs,
        ))  # fmt: skip

    async def detokenize(self, request: DetokenizeRequest) -> Response:
        check_model(request.model, self.chat.names)
        tokenizer = self._tokenizer()
        ids, vocab = request.tokens, self.engine.vocab_size
        if ids and max(ids) >= vocab:  # the model's vocabulary, as for a prompt's ids
            i = next(i for i, t in enumerate(ids) if t >= vocab)
            raise InvalidRequestError(
                f"token id {ids[i]} is not in the vocabulary [0, {vocab})", param=f"tokens[{i}]"
            )
        text = await off_loop(tokenizer.decode, ids)
        return json_response(DetokenizeResponse(prompt=text))

    def info(self) -> TokenizerInfo:
        """The served tokenizer's facts for the /v1/models card."""
        tokenizer, chat = self._tokenizer(), self.chat
        template = chat.encoder if isinstance(chat.encoder, PythonChatEncoder) else (
            self.engine.chat_template or getattr(tokenizer, "chat_template", None))
        return TokenizerInfo(vocab_size=tokenizer.vocab_size,
                             special_ids=sorted(set(tokenizer.all_special_ids)),
                             chat_template=bool(template))

    def _tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer (start it with --tokenizer)")
        return tokenizer

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        return self.chat.tokens.encode(text, add_special_tokens, UNBOUNDED, param)
