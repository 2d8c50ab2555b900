"""A client that hangs up on a non-streamed request aborts its generation: its KV blocks
are free within a second (a stream aborts when its body stops being read; a non-streamed
handler would otherwise run to max_tokens for nobody)."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import AUTH, MAX_MODEL_LEN
from tests.reliability.engine_gauges import (
    GENERATED,
    metric,
    send_raw,
    wait_until_idle,
    wait_until_running,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = MAX_MODEL_LEN - 40  # the prompts are shorter than 40 tokens
USER = [{"role": "user", "content": "drop me"}]
REQUESTS = {
    "completions": ("/v1/completions", {"prompt": "drop me", "max_tokens": MAX_TOKENS,
                                        "ignore_eos": True}),
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": MAX_TOKENS,
                                      "ignore_eos": True}),
    # No ignore_eos in Anthropic's API: greedy, this prompt runs to max_tokens.
    "messages": ("/v1/messages", {"model": "tiny", "messages": USER, "max_tokens": MAX_TOKENS,
                                  "temperature": 0.0}),
}


ATTEMPTS = 3  # a loaded machine's gauges can lag a whole (sub-second) generation


@pytest.mark.parametrize("route", REQUESTS)
def test_dropped_non_streamed_request_frees_its_kv_blocks(server, route):
    path, body = REQUESTS[route]
    for _ in range(ATTEMPTS):
        wait_until_idle(server.base_url, timeout=20)
        before = metric(server.base_url, GENERATED)
        sock = send_raw(server.base_url, path, body, AUTH)
        try:
            # Hang up as soon as it runs: a one-sequence generation of the tiny model can
            # end within half a second on an idle machine, so an attempt that sees it done
            # already proves nothing and goes again.
            wait_until_running(server.base_url)
            running = metric(server.base_url, "atom:num_requests_running") == 1
        finally:
            sock.close()
        if running:
            break
    else:
        pytest.fail(f"each of {ATTEMPTS} generations ended before the client hung up")
    freed_in = wait_until_idle(server.base_url, timeout=5)
    assert freed_in <= 1.0, f"KV blocks freed {freed_in:.2f} s after the client left"
    generated = metric(server.base_url, GENERATED) - before
    assert generated < MAX_TOKENS - 10, f"{generated} tokens: it ran (nearly) to the end"
