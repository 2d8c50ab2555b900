"""--timeout-graceful-shutdown: SIGTERM to the frontend closes the listener, lets
requests in flight finish for at most that long, aborts what is left (a stream's error
frame), stops the engine and exits 0."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.streams import StreamReader

pytestmark = pytest.mark.slow

GRACE_S = 8.0
# After the deadline: the aborted handlers end, the engine stops, the process exits (~1 s on
# a 2-core VM); the rest is a loaded CI machine's margin.
SLACK_S = 4.0
# 128 x 480 tokens with logprobs: about 100 s of work on a loaded 2-core VM, so it is still
# running at the deadline; the short one needs about 3 s next to it there.
LONG = {"prompt": "long", "n": 128, "max_tokens": 480, "ignore_eos": True, "stream": True,
        "logprobs": 5}
SHORT = {"prompt": "short", "max_tokens": 24, "ignore_eos": True, "stream": True}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_drains_then_aborts_and_exits_zero(start_server):
    srv = start_server("--max-model-len", "512", "--timeout-graceful-shutdown", str(GRACE_S))
    url = f"{srv.base_url}/v1/completions"
    long = StreamReader(url, LONG).started()
    short = StreamReader(url, SHORT).started()
    [engine_pid] = srv.engine_pids()
    # The frontend only: the group would be ServerProcess.stop.
    os.kill(srv.proc.pid, signal.SIGTERM)
    sent = time.monotonic()

    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(f"{srv.base_url}/health", timeout=5)
    short.join(GRACE_S)
    assert short.done and not short.errors, short.frames[-2:]
    assert short.finish_reasons() == ["length"]
    assert not long.done, "the long request finished within the grace period: make it longer"

    code = srv.proc.wait(GRACE_S + SLACK_S + 10)
    took = time.monotonic() - sent
    assert code == 0, srv.log()
    assert GRACE_S <= took < GRACE_S + SLACK_S, f"exited {took:.2f} s after SIGTERM"
    long.join(10)
    assert long.done and any("shutting down" in e["message"] for e in long.errors), long.frames[-2:]
    deadline = time.monotonic() + 10
    while alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(engine_pid), "the engine process outlived the frontend"
