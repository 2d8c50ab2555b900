"""``--chat-template``: a chat template that replaces the model's (the GGUF's, the
tokenizer's) wherever the model's would be read: rendering chats (the server's routes,
``LLMEngine.apply_chat_template``) and detecting the tool-call format, reasoning dialect and
thinking switch at start-up.

The value is read as vLLM reads it: a file's text if it names a file, else the template
itself when it holds Jinja's ``{``/``}`` or a newline, with backslash escapes (``\\n``)
decoded, so a one-line template typed in a shell can hold newlines. Anything else is a
path that does not exist. Either way the template must compile: a mistake is one
ConfigError at start-up, not a 400 on every chat request.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from atom_core.errors import ConfigError
from atom_core.parsing.chat_encoders import JinjaChatEncoder

_INLINE_MARKS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template ``--chat-template value`` names (ConfigError if none, or if it does not
    compile)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {value}: cannot read it ({exc})") from None
        where = str(path)
    elif path.is_dir():
        raise ConfigError(f"--chat-template {value} is a directory; name the template file")
    elif any(mark in value for mark in _INLINE_MARKS):
        try:
            template = _unescape(value)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"--chat-template: a bad escape in the inline template ({exc})"
                              ) from None
        where = "the inline template"
    else:
        raise ConfigError(f"--chat-template {value}: no such file (and, without {{ or }}, "
                          "not a Jinja template either)")
    try:
        JinjaChatEncoder(template)
    except ConfigError as exc:
        line = getattr(exc.__cause__, "lineno", None)
        at = f", line {line}" if line else ""
        raise ConfigError(f"--chat-template: {where}{at}: {exc}") from None
    return template


def _unescape(text: str) -> str:
    r"""``\n``, ``\t``, ``\\`` ... decoded, as vLLM decodes an inline template; characters
    beyond Latin-1 pass through as themselves (vLLM's plain ``unicode_escape`` would read
    their UTF-8 bytes as Latin-1)."""
    return codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")
