"""The server with speculative decoding (--method ngram, and draft_model with the target
as its own draft): several tokens per step reach the SSE stream byte for byte as the
non-streamed response, n > 1 works, and /debug/mtp_stats, /metrics and `atom bench
serve`'s reader report acceptance."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from atom_core.benchmarks.benchmark_serving import spec_decode_stats
from atom_core.entrypoints.server_process import ServerProcess
from atom_core.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow

# A looping prompt: the n-gram proposer finds its 5-token tails in it.
PROMPT = "one two three four five six seven " * 3


def method_flags(method: str) -> tuple[str, ...]:
    if method == "draft_model":
        return ("--method", method, "--draft-model", str(tiny_model_dir("llama")))
    return ("--method", method)


@pytest.fixture(scope="module", params=["draft_model", "ngram"])
def server(request, tmp_path_factory):
    logs = tmp_path_factory.mktemp("spec")
    srv = ServerProcess(
        tiny_model_dir("llama"), "--max-model-len", "512", "--served-model-name", "tiny",
        *method_flags(request.param), "--num-speculative-tokens", "3", log=logs / "server.log",
    ).wait_ready()
    yield srv
    srv.stop()


def test_stream_equals_non_stream_and_drafts_are_accepted(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    kw = dict(model="tiny", prompt=PROMPT, temperature=0, max_tokens=60)
    full = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full.choices[0].text and full.usage.completion_tokens == 60
    two = client.completions.create(**{**kw, "n": 2})
    assert [c.text for c in two.choices] == [full.choices[0].text] * 2

    stats = httpx.get(f"{server.base_url}/debug/mtp_stats").json()
    assert stats["enabled"] and stats["total_draft_tokens"] > 0
    assert stats["total_accepted_tokens"] > 0
    assert stats["average_tokens_per_forward"] == pytest.approx(
        1 + stats["total_accepted_tokens"] / stats["num_verifications"])
    metrics = httpx.get(f"{server.base_url}/metrics").text
    m = re.search(r"^atom:mtp_average_tokens_per_forward\{[^}]*\} (\S+)$", metrics, re.M)
    assert m and float(m.group(1)) == pytest.approx(stats["average_tokens_per_forward"])
    length, rate = asyncio.run(spec_decode_stats(server.base_url))
    assert (length, rate) == (pytest.approx(stats["average_tokens_per_forward"]),
                              pytest.approx(stats["acceptance_rate"]))
