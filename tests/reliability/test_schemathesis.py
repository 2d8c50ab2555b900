"""Schemathesis over the document the server serves (/openapi.json): a seeded run of more
than 1,000 generated requests, each answered without a 5xx, with a status the document
lists for its operation, and a body matching that status's schema.

Requests are drawn from each operation's request schema, valid ones (positive) and ones
that break it (negative), through schemathesis's Hypothesis strategies. Streamed replies
are checked event by event. Three narrowings, all for time (CI has 2 cores):

- a request names the served model: any other name is a 404, which the document lists,
  and would end nearly every /v1/messages request there;
- no unknown fields are drawn (``additionalProperties`` off in this copy of the
  document): the server ignores them, and drawing them triples the cost of a request;
- the server has a context of 64 tokens and at most 2 sequences per request, so no reply
  is long (a request over those limits is a 400), and runs torch on one thread: this test
  draws requests on one of the two cores, and torch's threads waiting for a core they
  share with it make a step of two sequences 20 to 50 times slower (measured with
  n = 2 and 50 tokens: 3.5 to 8.5 s, against 0.15 s on one thread).

/start_profile and /stop_profile are left out: they start the torch profiler.
"""

from __future__ import annotations

import collections
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, reject, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.errors import FailureGroup, InvalidSchema

from tests.reliability.conftest import AUTH, SERVER_FLAGS

pytestmark = pytest.mark.slow

SEED = 35
# Examples per operation; an operation without parameters has one possible request.
EXAMPLES = {
    "POST /v1/chat/completions": 400,
    "POST /v1/completions": 400,
    "POST /v1/messages": 250,
    # Answered by the frontend alone (no engine step): many examples cost little.
    "POST /v1/messages/count_tokens": 100,
    "POST /tokenize": 150,
    "POST /detokenize": 100,
    "GET /v1/models": 1,
    "GET /health": 1,
    "GET /version": 1,
    "GET /metrics": 1,
    "GET /debug/mtp_stats": 1,
}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
REQUEST_SCHEMAS = (
    "ChatCompletionRequest", "CompletionRequest", "MessagesRequest", "CountTokensRequest",
    "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest",
)  # fmt: skip


def fuzz_flags() -> list[str]:
    flags = list(SERVER_FLAGS)
    flags[flags.index("--max-model-len") + 1] = "64"
    return [*flags, "--max-sequences-per-request", "2"]


@pytest.fixture(scope="module")
def fuzz_server(start_server):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # inherited by the server and its engine
        return start_server(*fuzz_flags())


@pytest.fixture(scope="module")
def api(fuzz_server) -> schemathesis.BaseSchema:
    doc = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=30).json()
    model = fuzz_flags()[fuzz_flags().index("--served-model-name") + 1]
    schemas = doc["components"]["schemas"]
    for name in REQUEST_SCHEMAS:
        schemas[name]["properties"]["model"] = {"const": model}
    for schema in schemas.values():
        if schema.get("additionalProperties") is True:
            schema["additionalProperties"] = False
    return schemathesis.openapi.from_dict(doc)


def test_every_served_operation_is_fuzzed(api):
    labels = {result.ok().label for result in api.get_all_operations()}
    assert labels - EXAMPLES.keys() == {"POST /start_profile", "POST /stop_profile"}
    assert sum(EXAMPLES.values()) >= 1000


@pytest.mark.parametrize("label", EXAMPLES)
def test_answers_conform_to_the_document(api, fuzz_server, label):
    method, path = label.split(" ", 1)
    operation = api[path][method]
    modes = [GenerationMode.POSITIVE]
    if list(operation.body):  # nothing to break in a request without parameters
        modes.append(GenerationMode.NEGATIVE)
    strategy = st.one_of([operation.as_strategy(generation_mode=mode) for mode in modes])
    statuses: collections.Counter[int] = collections.Counter()
    failures: list[str] = []
    waited = 0.0  # on the server
    unmade = 0  # requests schemathesis could not draw

    @seed(SEED)
    @settings(
        max_examples=EXAMPLES[label], database=None, deadline=None,
        phases=[Phase.generate],  # failures are collected, not raised: nothing to shrink
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(st.data())
    def run(data: st.DataObject) -> None:
        nonlocal waited, unmade
        try:
            case = data.draw(strategy)
        except InvalidSchema:
            # Its negative mode sometimes builds a schema it cannot satisfy ("Cannot
            # generate an array with 1 demanded elements" for /v1/messages' role union).
            unmade += 1
            reject()
        sent = time.monotonic()
        response = case.call(base_url=fuzz_server.base_url, headers=AUTH, timeout=60)
        waited += time.monotonic() - sent
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as exc:  # one failed check, or several
            failures.append(f"{case.as_curl_command(headers=AUTH)}\n{exc}")

    started = time.monotonic()
    run()
    print(f"{label}: {sum(statuses.values())} requests in {time.monotonic() - started:.1f} s "
          f"({waited:.1f} s waiting for answers), statuses {dict(sorted(statuses.items()))}, "
          f"{unmade} not drawn")  # fmt: skip
    assert not failures, f"{len(failures)} failures; the first:\n" + "\n\n".join(failures[:3])
    assert sum(statuses.values()) >= EXAMPLES[label]
