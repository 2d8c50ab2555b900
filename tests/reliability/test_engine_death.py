"""The engine process dies (kill -9) while a stream runs. The choice is that the
frontend exits non-zero within 2 s, so that its supervisor restarts the whole server; the
stream in flight ends with an error frame (or its connection closes), it does not hang."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.reliability.streams import StreamReader

pytestmark = pytest.mark.slow

LONG = {"prompt": "long", "n": 8, "max_tokens": 480, "ignore_eos": True, "stream": True}


def test_engine_kill_under_a_stream_exits_nonzero_within_2s(start_server):
    srv = start_server("--max-model-len", "512")
    stream = StreamReader(f"{srv.base_url}/v1/completions", LONG).started()
    [engine_pid] = srv.engine_pids()
    os.kill(engine_pid, signal.SIGKILL)
    killed = time.monotonic()
    code = srv.proc.wait(30)
    took = time.monotonic() - killed
    assert code == 1, srv.log()
    assert took < 2.0, f"the frontend took {took:.2f} s to exit"
    stream.join(10)
    assert not stream.is_alive(), "the stream hangs"
    ended_with_error = stream.done and any("engine" in e["message"] for e in stream.errors)
    assert ended_with_error or stream.failure is not None, stream.frames[-3:]
    assert stream.finish_reasons().count("length") < LONG["n"]  # it was cut, not finished
    assert "the engine process died" in srv.log()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return ") Z " not in stat  # a zombie has exited


def test_a_tensor_parallel_worker_killed_under_a_stream_stops_the_server(start_server):
    """-tp 2 on CPU: rank 1 is a child of the engine process. Killed mid-stream, the engine
    fails at its next step, the frontend exits non-zero within 2 s of that and no process of
    the server is left."""
    srv = start_server("--max-model-len", "512", "-tp", "2", "--device", "cpu")
    stream = StreamReader(f"{srv.base_url}/v1/completions", LONG).started()
    [engine_pid] = srv.engine_pids()
    [worker_pid] = _children(engine_pid)
    os.kill(worker_pid, signal.SIGKILL)
    killed = time.monotonic()
    code = srv.proc.wait(30)
    took = time.monotonic() - killed
    assert code == 1, srv.log()
    assert took < 2.0, f"the frontend took {took:.2f} s to exit"
    stream.join(10)
    assert not stream.is_alive(), "the stream hangs"
    assert stream.finish_reasons().count("length") < LONG["n"]
    assert "tensor-parallel rank 1 died" in srv.log_path.read_text()
    deadline = time.monotonic() + 5
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine_pid)
