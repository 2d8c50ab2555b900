"""--chat-template: a file or inline Jinja replacing the model's template for rendering and for
the start-up detection; a wrong one refused when the config is validated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atom_core import LLMEngine
from atom_core.config import Config
from atom_core.entrypoints.http.openai.chat import resolve_chat_parser
from atom_core.errors import ConfigError
from atom_core.loader import load_tokenizer
from atom_core.testing.tiny_models import tiny_model_dir
from tests.parsing.shared_templates import template_path

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>>"


def engine(**kw) -> LLMEngine:
    return LLMEngine(str(tiny_model_dir("llama")), device="cpu", enable_log_stats=False, **kw)


def test_a_file_replaces_the_models_template(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert engine().apply_chat_template(CHAT).startswith("<|im_start|>system\n")  # the model's
    assert engine(chat_template=str(path)).apply_chat_template(CHAT) == (
        "[system] Be brief.\n[user] Hi\n>>"
    )


def test_inline_text_is_the_template_with_its_escapes_read():
    inline = "{% for m in messages %}{{ m.content }}\\n{% endfor %}｜é"  # a shell's \n
    assert engine(chat_template=inline).apply_chat_template(CHAT) == "Be brief.\nHi\n｜é"


def test_the_server_reads_it_and_detects_its_tool_format():
    model = str(tiny_model_dir("llama"))
    tokenizer, template = load_tokenizer(Config.from_kwargs(model=model))
    plain = SimpleNamespace(tokenizer=tokenizer, chat_template=template)
    assert resolve_chat_parser(plain, model)[0].tool_format is None  # ChatML, no tools
    qwen3 = template_path("qwen3")
    config = Config.from_kwargs(model=model, chat_template=str(qwen3))
    tokenizer, template = load_tokenizer(config)
    assert template == qwen3.read_text() == tokenizer.chat_template
    parser, _ = resolve_chat_parser(SimpleNamespace(tokenizer=tokenizer, chat_template=template),
                                    None)
    assert parser.tool_format.name == "hermes" and parser.dialect.name == "think"
    assert parser.thinking_switch.kwarg == "enable_thinking"


@pytest.mark.parametrize(
    "value,message",
    [
        ("missing.jinja", "missing.jinja: no such file"),
        ("{% for m in messages %}", "the inline template, line 1: chat template does not "
                                    "compile"),
        ("{{ x }}\\N{nope}", "a bad escape"),
    ],
)
def test_a_wrong_template_is_one_config_error(value, message):
    with pytest.raises(ConfigError, match="--chat-template") as err:
        Config.from_kwargs(chat_template=value)
    assert message in str(err.value)


def test_a_file_that_does_not_compile_names_its_line(tmp_path):
    path = tmp_path / "bad.jinja"
    path.write_text("{{ bos_token }}\n{{ messages | }}\n")
    with pytest.raises(ConfigError, match=f"{path}, line 2: chat template does not compile"):
        Config.from_kwargs(chat_template=str(path))
    with pytest.raises(ConfigError, match="is a directory"):
        Config.from_kwargs(chat_template=str(tmp_path))
