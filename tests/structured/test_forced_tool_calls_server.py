"""tool_choice "required" through a real ``atom serve``: a tiny random model behind Qwen3's
chat template (the hermes format, detected at start-up), sampled at temperature 1 with a
seed. The grammar makes the random model's reply a call of a declared function, with
arguments valid under its schema, and the same seed gives the same call streamed and not."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from atom_core.entrypoints.server_process import ServerProcess
from atom_core.testing.tiny_models import tiny_model_dir
from tests.parsing.shared_templates import template_path
from tests.structured.test_forced_tool_calls import SCHEMAS, TOOLS

pytestmark = pytest.mark.slow

# The tiny tokenizer spends a token per byte: Qwen3's tool prompt needs more positions than
# the tiny model's 512.
POSITIONS = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("forced")
    model = root / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (model / "config.json").write_text(json.dumps(config))
    srv = ServerProcess(model, "--chat-template", str(template_path("qwen3")),
                        "--max-model-len", str(POSITIONS), "--served-model-name", "tiny",
                        log=root / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_required_gives_the_same_valid_call_streamed_and_not(server):
    assert "tool-call format: hermes" in server.log_path.read_text()
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    # Thinking off: a random model that opened a reasoning block would never close it.
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, max_tokens=300,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    full = oai.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls]
    assert len(calls) >= 1
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])

    streamed, finish = {}, None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or ():
            call = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == calls
