"""tool_choice "required" and a named function force a call in the model's own format.

Each format's grammar (``forced_call_grammar``, from the format the vendor's chat template
resolves to, or the one named where no template is public) constrains 50 seeded samples
per tool_choice at temperature 1 on a tiny random model; every reply is read back by the
format's own reader (the server's ResponseParser) into calls of declared functions whose
arguments validate against their schemas. The reasoning block in
front of the calls is checked on the matcher, text by text: a random model never writes
the end marker by chance.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.errors import InvalidRequestError
from atom_core.parsing.call_grammar import forced_call_grammar
from atom_core.parsing.chat_encoders import JinjaChatEncoder
from atom_core.parsing.reasoning_dialects import resolve_dialect
from atom_core.parsing.response import ResponseParser, special_tokens
from atom_core.parsing.tool_format import ToolFormat
from atom_core.sampling_params import SamplingParams
from atom_core.structured import StructuredSpec
from atom_core.testing.tiny_models import VOCAB_SIZE, build_tokenizer, tiny_model_dir
from tests.parsing.shared_templates import template_path

pytestmark = pytest.mark.slow

# Strings bounded and no extra properties: a random model samples uniformly among what
# the grammar allows and must still finish inside max_tokens.
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 6},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object",
        "properties": {"tz": {"type": "string", "minLength": 1, "maxLength": 4},
                       "precise": {"type": "boolean"}},
        "required": ["tz", "precise"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
N = 50
# template -> the format it resolves to, and the kwargs that switch thinking off (a random
# model never closes a reasoning block: that path is checked on the matcher below).
# MiniMax-M2's prompt always opens the block, and gpt-oss's and Kimi-K3's leave it optional
# with no switch: their samples run without the dialect.
TEMPLATES = {
    "qwen3": ("hermes", {"enable_thinking": False}),
    "qwen3_coder": ("qwen", {}),
    "deepseek_v3_1": ("deepseek_v31", {"thinking": False}),
    "kimi_k2": ("kimi", {}),
    "glm4_5": ("glm", {"enable_thinking": False}),
    "minimax_m2": ("minimax", {}),
    "deepseek_v3_2_dsml_llamacpp": ("dsml", {}),
    "gpt_oss": ("harmony", {}),
}
# Formats whose vendor template is not public (kimi_k3_tokens.py): named, with the tiny
# tokenizer's own prompt.
NAMED_FORMATS = {"kimi_k3"}
WITHOUT_DIALECT = {"minimax_m2", "gpt_oss", "kimi_k3"}


class Case:
    """A vendor template (or a named format) on the tiny byte-level tokenizer: its format,
    its dialect (None where the template names none) and the rendered prompt."""

    def __init__(self, template: str) -> None:
        self.tokenizer = build_tokenizer()
        if template in NAMED_FORMATS:
            parser = ResponseParser.from_names(template, template)
            expected, kwargs, dialect = template, {}, parser.dialect
        else:
            source = template_path(template).read_text()
            self.tokenizer.chat_template = source
            parser = ResponseParser.resolve(JinjaChatEncoder(source, {}))
            (expected, kwargs), dialect = TEMPLATES[template], resolve_dialect(source).dialect
        assert parser.tool_format is not None and parser.tool_format.name == expected
        self.format: ToolFormat = parser.tool_format
        self.own_dialect = dialect  # what the server reads with
        self.dialect = None if template in WITHOUT_DIALECT else dialect
        self.parser = ResponseParser(self.format, self.dialect)
        self.prompt = self.tokenizer.apply_chat_template(
            USER, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)

    def grammar(self, tool_choice, parallel: bool = True, prompt: str | None = None,
                dialect=None) -> str:
        grammar = forced_call_grammar(self.format, dialect or self.dialect,
                                      self.prompt if prompt is None else prompt, TOOLS,
                                      tool_choice, parallel, special_tokens(self.tokenizer))
        assert grammar is not None
        return grammar

    def calls(self, text: str, tool_choice, parallel: bool = True) -> list[tuple[str, dict]]:
        parsed = self.parser.read_whole(text, prompt=self.prompt, tools=TOOLS,
                                        tool_choice=tool_choice, parallel_tool_calls=parallel)
        return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.fixture(scope="module")
def eng() -> LLMEngine:
    return LLMEngine(str(tiny_model_dir("llama")), device="cpu", enable_log_stats=False,
                     max_model_len=512)


def sample(eng: LLMEngine, grammars: list[str]) -> list[dict]:
    """N seeded samples under each grammar, in one batch."""
    params = []
    for grammar in grammars:
        spec = StructuredSpec("grammar", grammar, "tool_choice")
        spec.validate()
        params += [SamplingParams(temperature=1.0, seed=i, structured=spec, max_tokens=400)
                   for i in range(N)]
    return eng.generate([[1 + i % 200, 2, 3] for i in range(len(params))], params)


def assert_valid(case: Case, outs: list[dict], tool_choice, parallel: bool) -> list[list]:
    every = []
    for out in outs:
        assert out["finish_reason"] == "stop", out["text"]
        calls = case.calls(out["text"], tool_choice, parallel)
        assert calls, out["text"]
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        every.append(calls)
    return every


@pytest.mark.parametrize("template", [*TEMPLATES, *NAMED_FORMATS])
def test_required_and_named_samples_are_all_valid_calls(eng, template):
    case = Case(template)
    outs = sample(eng, [case.grammar("required", parallel=False), case.grammar(NAMED)])
    required = assert_valid(case, outs[:N], "required", False)
    assert all(len(c) == 1 for c in required)
    assert {c[0][0] for c in required} == {"get_weather", "get_time"}  # either may be chosen
    named = assert_valid(case, outs[N:], NAMED, True)
    assert all([name for name, _ in c] == ["get_time"] for c in named)
    assert len({json.dumps(c) for c in named}) > N // 2  # the seeds gave different calls


def matcher(case: Case, grammar: str):
    tokenizer = llguidance.hf.from_tokenizer(case.tokenizer, n_vocab=VOCAB_SIZE,
                                             eos_token=[case.tokenizer.eos_token_id])
    m = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("grammar", grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(case: Case, grammar: str, text: str) -> bool:
    m = matcher(case, grammar)
    ids = case.tokenizer.encode(text, add_special_tokens=False)
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


def test_reasoning_comes_first_and_only_the_call_is_constrained():
    case = Case("qwen3")
    call = case.format.render_call("get_time", {"tz": "UTC", "precise": True})
    thought = "The user wants <tool_call> and a < b; call get_time."
    opened = case.prompt.replace("<think>\n\n</think>\n\n", "<think>\n")  # R1-style prompt
    inside = case.grammar("required", prompt=opened)
    assert accepts(case, inside, f"{thought}\n</think>\n\n{call}")
    assert not accepts(case, inside, call)  # the open block must close first
    assert not accepts(case, inside, f"{thought}\n</think>\n\nNo call.")
    thinking_on = case.grammar("required", prompt=opened.removesuffix("<think>\n"))
    assert accepts(case, thinking_on, f"<think>\n{thought}\n</think>\n\n{call}")
    assert accepts(case, thinking_on, call)  # the block is optional
    closed = case.grammar("required")  # thinking off: the prompt closed the block
    assert accepts(case, closed, call)
    assert not accepts(case, closed, f"<think>\n{thought}\n</think>\n\n{call}")


@pytest.mark.parametrize("template", ["qwen3", "qwen3_coder", "glm4_5"])
def test_required_takes_several_calls_unless_parallel_calls_are_off(template):
    case = Case(template)
    one = case.format.render_call("get_time", {"tz": "UTC", "precise": True})
    two = one + "\n" + case.format.render_call("get_weather", {"city": "Rome", "days": 2})
    assert case.calls(two, "required") == [("get_time", {"tz": "UTC", "precise": True}),
                                           ("get_weather", {"city": "Rome", "days": 2})]
    assert accepts(case, case.grammar("required"), two)
    assert accepts(case, case.grammar("required", parallel=False), one)
    assert not accepts(case, case.grammar("required", parallel=False), two)
    assert not accepts(case, case.grammar(NAMED), two)


# The reasoning block in each format's own spelling (harmony's call is a new message),
# and the markers its vendor's tokenizer holds as special tokens.
THOUGHTS = {
    "gpt_oss": ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant",
                ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>",
                 "<|end|>"]),
    "kimi_k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>",
                ["<|open|>", "<|close|>", "<|sep|>"]),
}


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("template", list(THOUGHTS))
def test_a_channel_format_reasons_first_and_its_calls_read_back(template, special):
    case = Case(template)
    opener, closer, markers = THOUGHTS[template]
    if special:  # then the grammar must match each marker as its one token
        case.tokenizer.add_tokens(markers, special_tokens=True)
        assert all(len(case.tokenizer.encode(m, add_special_tokens=False)) == 1
                   for m in markers)
    call = case.format.render_call("get_time", {"tz": "UTC", "precise": True})
    grammar = case.grammar("required", dialect=case.own_dialect)
    thought = "Need the time."
    if not special:  # as special tokens, these would be markup rather than prose
        thought += " <|channel|>commentary to=functions.x and <|open|>call are prose."
    assert accepts(case, grammar, call)  # the block is optional
    assert accepts(case, grammar, f"{opener}{thought}{closer}{call}")
    assert not accepts(case, grammar, f"{opener}{thought}{closer}No call.")
    parsed = ResponseParser(case.format, case.own_dialect).read_whole(
        f"{opener}{thought}{closer}{call}", prompt=case.prompt, tools=TOOLS,
        tool_choice="required")
    assert parsed.reasoning_content == thought
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_time", {"tz": "UTC", "precise": True})]


def test_harmony_writes_one_call_and_kimi_k3_several():
    one, two = ({"tz": "UTC", "precise": True}, {"city": "Rome", "days": 2})
    harmony = Case("gpt_oss")
    call = harmony.format.render_call("get_time", one)
    # <|call|> is a stop token: a turn holds one call even with parallel calls on.
    assert accepts(harmony, harmony.grammar("required"), call)
    assert not accepts(harmony, harmony.grammar("required"), call + "<|start|>assistant"
                       + harmony.format.render_call("get_weather", two))
    kimi = Case("kimi_k3")
    calls = kimi.format.render_call("get_time", one) + kimi.format.render_call(
        "get_weather", two)
    assert kimi.calls(calls, "required") == [("get_time", one), ("get_weather", two)]
    assert accepts(kimi, kimi.grammar("required"), calls)
    assert not accepts(kimi, kimi.grammar("required", parallel=False), calls)
    assert not accepts(kimi, kimi.grammar(NAMED), calls)


def test_a_named_call_refuses_the_other_function_and_bad_arguments():
    case = Case("qwen3")
    grammar = case.grammar(NAMED)
    assert accepts(case, grammar, case.format.render_call("get_time", {"tz": "UTC",
                                                                        "precise": False}))
    assert not accepts(case, grammar, case.format.render_call("get_weather", {"city": "Rome"}))
    assert not accepts(case, grammar, case.format.render_call("get_time", {"tz": "UTC"}))


def test_a_format_without_a_grammar_is_refused_by_name():
    class Plain(ToolFormat):
        name = "plain"

    with pytest.raises(InvalidRequestError, match="not supported with the plain tool-call "
                                                  "format") as err:
        forced_call_grammar(Plain(), None, "", TOOLS, "required")
    assert err.value.param == "tool_choice"
    assert forced_call_grammar(Plain(), None, "", TOOLS, "auto") is None
