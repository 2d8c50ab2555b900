"""Rendering a model's chat template, and the start-up probes of it.

Two kinds of template: a Jinja string (rendered the way transformers renders it: a
sandboxed environment with ``trim_blocks``/``lstrip_blocks``, loop controls, and the
usual ``raise_exception``, ``strftime_now`` and HTML-safe-free ``tojson``), or a
model-side Python encoder, ``<model>/encoding/encoding_*.py``, which is how DeepSeek-V4
ships its. A Jinja template ignores a keyword it does not read; a Python encoder raises
TypeError, so its signature is read once and only what it takes is passed. Both take
``continue_final_message`` as transformers' ``apply_chat_template`` does
(``render_continuing``).

The probes, run once at start-up:

- ``render_probe_prompt``: the template rendered with a tools payload and a tool-call
  turn, i.e. what the prompt tells the model a call looks like; the tool-call format is
  detected on it.
- ``chat_template_source``: what the template does with a reply; the reasoning dialect is
  detected on it.
- ``resolve_thinking_switch``: which keyword turns reasoning off, found by rendering twice
  and comparing (a template silently ignores a keyword it does not read).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from atom_core.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

# transformers' own marker, so a prompt rendered here ends where apply_chat_template(
# continue_final_message=True) ends the same template's.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatEncoder(ABC):
    """Turns messages (+ tools) into the prompt text. ``source`` is the template's text."""

    source: str = ""

    @abstractmethod
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        ...


def render_continuing(
    render: Callable[[list[dict[str, Any]]], str], messages: Sequence[Mapping[str, Any]]
) -> str:
    """``render(messages)`` cut where the final message's content ends, so that the model
    continues that message (a prefilled reply): what the template writes after it (its
    end-of-turn marker) is left out. As transformers does it: a marker is appended to the
    content and the text is cut at the marker's last occurrence (``rfind``), or just
    before the whitespace the template trimmed off the content. A template that does not
    write the final content as sent is a 400: there is no place to cut."""
    messages = [dict(m) for m in messages]
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str):
        raise InvalidRequestError(
            "continue_final_message needs the final message to have text content",
            param="messages",
        )
    messages[-1]["content"] = content + _CONTINUE_TAG
    text = render(messages)
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0 or content.strip() not in text[:at]:
        raise InvalidRequestError(
            "continue_final_message: the chat template does not write the final message's "
            "content as sent, so the prompt cannot end inside it",
            param="messages",
        )
    if text.startswith(_CONTINUE_TAG, at):
        return text[:at]
    return text[:at].rstrip()


def _check_prompt_ending(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true: one opens "
            "a new assistant turn, the other continues the final message"
        )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask tag): renders
    its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not see.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads  # llama.cpp's templates (DSML) use it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class JinjaChatEncoder(ChatEncoder):
    """A Jinja chat template; ``special_tokens`` (bos_token, eos_token, ...) are passed to it."""

    def __init__(self, template: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = template
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _jinja_env().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template does not compile: {exc}") from exc

    def render(self, messages, tools=None, add_generation_prompt=True,
               continue_final_message=False, **kwargs) -> str:
        _check_prompt_ending(add_generation_prompt, continue_final_message)
        context = {"bos_token": "", "eos_token": "", **self.special_tokens, **kwargs}

        def render(messages: list[dict[str, Any]]) -> str:
            return self._template.render(
                messages=messages, tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, **context,
            )

        if continue_final_message:
            return render_continuing(render, messages)
        return render(list(messages))


class PythonChatEncoder(ChatEncoder):
    """A model-side encoder module; its ``encode_messages`` (or first ``encode*``) function
    is called with the messages and only the keywords its signature takes."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path
        self.source = path.read_text(encoding="utf-8")
        spec = importlib.util.spec_from_file_location(f"atom_chat_encoder_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, "encode_messages", None) or next(
            (getattr(module, n) for n in sorted(dir(module))
             if n.startswith("encode") and callable(getattr(module, n))),
            None,
        )
        if fn is None:
            raise ConfigError(f"{path} has no encode_messages function")
        self._fn: Callable[..., Any] = fn
        params = inspect.signature(fn).parameters.values()
        self._takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self._names = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}

    def takes(self, name: str) -> bool:
        return self._takes_any or name in self._names

    def render(self, messages, tools=None, add_generation_prompt=True,
               continue_final_message=False, **kwargs) -> str:
        _check_prompt_ending(add_generation_prompt, continue_final_message)
        if continue_final_message:
            return render_continuing(
                lambda ms: self.render(ms, tools, add_generation_prompt, **kwargs), messages
            )
        messages = [dict(m) for m in messages]
        kw = {k: v for k, v in kwargs.items() if self.takes(k)}
        ignored = sorted(set(kwargs) - set(kw))
        if ignored:
            logger.debug("chat encoder %s does not take %s; not passed",
                         self.path.name, ", ".join(ignored))
        if self.takes("add_generation_prompt"):
            kw["add_generation_prompt"] = add_generation_prompt
        if tools:
            if self.takes("tools"):
                kw["tools"] = list(tools)
            else:  # DeepSeek's encoders read the tools off the system message
                if not messages or messages[0].get("role") != "system":
                    messages.insert(0, {"role": "system", "content": ""})
                messages[0]["tools"] = list(tools)
        out = self._fn(messages, **kw)
        return out if isinstance(out, str) else "".join(out)


def load_chat_encoder(model: str | Path) -> ChatEncoder | None:
    """The chat encoder of a model directory (encoding/encoding_*.py, chat_template.jinja,
    or tokenizer_config.json's chat_template), or of a template file; None if it has none."""
    path = Path(model)
    if path.is_file():
        if path.suffix == ".py":
            return PythonChatEncoder(path)
        if path.suffix == ".json":
            return _from_tokenizer_config(path)
        return JinjaChatEncoder(path.read_text(encoding="utf-8"))
    encoders = sorted((path / "encoding").glob("encoding_*.py"))
    if encoders:
        return PythonChatEncoder(encoders[0])
    special = _special_tokens(path / "tokenizer_config.json")
    if (path / "chat_template.jinja").is_file():
        return JinjaChatEncoder((path / "chat_template.jinja").read_text(encoding="utf-8"), special)
    if (path / "tokenizer_config.json").is_file():
        return _from_tokenizer_config(path / "tokenizer_config.json")
    return None


def _special_tokens(config_path: Path) -> dict[str, str]:
    if not config_path.is_file():
        return {}
    config = json.loads(config_path.read_text(encoding="utf-8"))
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        tok = config.get(key)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if isinstance(tok, str):
            out[key] = tok
    return out


def _from_tokenizer_config(config_path: Path) -> ChatEncoder | None:
    template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str):
        return None
    return JinjaChatEncoder(template, _special_tokens(config_path))


# -- start-up probes --------------------------------------------------------------------

PROBE_TOOL_NAME = "get_weather"
PROBE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": PROBE_TOOL_NAME,
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
            },
        },
    }
]
_PROBE_CALL_ID = f"functions.{PROBE_TOOL_NAME}:0"  # Kimi's templates print the id verbatim


def _probe_messages(arguments: Any) -> list[dict[str, Any]]:
    function = {"name": PROBE_TOOL_NAME, "arguments": arguments}
    call = {"id": _PROBE_CALL_ID, "type": "function", "function": function}
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": _PROBE_CALL_ID, "name": PROBE_TOOL_NAME,
         "content": "Sunny, 21 C"},
    ]


def render_probe_prompt(encoder: ChatEncoder) -> str | None:
    """The template rendered with a tools payload and one tool-call turn (arguments as an
    object, or as a JSON string for templates that concatenate them); None if it renders
    neither way."""
    errors = []
    for arguments in ({"city": "Paris"}, json.dumps({"city": "Paris"})):
        try:
            return encoder.render(copy.deepcopy(_probe_messages(arguments)), tools=PROBE_TOOLS)
        except Exception as exc:  # a template that rejects the probe must not stop start-up
            errors.append(f"{type(exc).__name__}: {exc}")
    logger.warning("chat template would not render a tool-call turn (%s)", "; ".join(errors))
    return None


def chat_template_source(encoder: ChatEncoder | None) -> str:
    """What the template does with a reply: its source text."""
    return encoder.source if encoder is not None else ""


@dataclass(frozen=True)
class ThinkingSwitch:
    """The template keyword that turns reasoning on and off, and its two values."""

    kwarg: str
    on: Any
    off: Any

    def kwargs(self, enabled: bool) -> dict[str, Any]:
        return {self.kwarg: self.on if enabled else self.off}


THINKING_SWITCH_CANDIDATES: tuple[ThinkingSwitch, ...] = (
    ThinkingSwitch("enable_thinking", True, False),
    ThinkingSwitch("thinking", True, False),
    ThinkingSwitch("thinking_mode", "thinking", "chat"),
    ThinkingSwitch("thinking_mode", "enabled", "disabled"),
)


def resolve_thinking_switch(encoder: ChatEncoder | None) -> ThinkingSwitch | None:
    """The first candidate keyword whose two values render different prompts; None when
    the template has no switch (its reasoning cannot be turned off in the prompt)."""
    if encoder is None:
        return None
    messages = [{"role": "user", "content": "Hello"}]
    for switch in THINKING_SWITCH_CANDIDATES:
        if isinstance(encoder, PythonChatEncoder) and not encoder.takes(switch.kwarg):
            continue
        try:
            on = encoder.render(messages, **switch.kwargs(True))
            off = encoder.render(messages, **switch.kwargs(False))
        except Exception:
            continue
        if on != off:
            return switch
    return None
