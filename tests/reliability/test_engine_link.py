"""The engine link (frontend <-> engine process) is private, and the engine dies with its
frontend.

The link is two ZMQ sockets on ipc:// paths in a per-start 0700 directory, bound by the
frontend as CURVE servers that accept only the engine's key (core_link). These tests run as
root in CI, who can enter the directory: what keeps a foreign process out is CURVE.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import zmq

from atom_core.engine.core_link import LinkServer
from atom_core.engine.core_messages import AddRequest, Control, EngineFailed, encoder
from atom_core.engine.core_process import run_engine_core
from atom_core.entrypoints.server_process import ServerProcess, socket_inodes
from atom_core.sampling_params import SamplingParams
from tests.reliability.conftest import AUTH, SERVER_FLAGS

# ------------------------------------------------------------------------------ helpers


def link_dir(pid: int) -> Path:
    """The directory of the engine link that process ``pid`` listens on (its bound unix
    sockets, found through /proc)."""
    inodes = socket_inodes(pid)
    dirs = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) == 8 and cols[6] in inodes and "atom-engine-" in cols[7]:
            dirs.add(Path(cols[7]).parent)
    assert len(dirs) == 1, f"engine link sockets of {pid}: {dirs}"
    return dirs.pop()


def is_dead(pid: int) -> bool:
    """Gone, or a zombie (killed, not reaped yet by its new parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def complete(base_url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def foreign_socket(ctx: zmq.Context, kind: int, endpoint: str, curve: bool) -> zmq.Socket:
    """A local peer that found the path: no security (NULL), or CURVE with keys of its own
    and a guess at the server's key."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if curve:
        sock.curve_serverkey = zmq.curve_keypair()[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    return sock


def send_or_drop(sock: zmq.Socket, payload: bytes) -> None:
    try:
        sock.send(payload, zmq.NOBLOCK)  # queued until a handshake that never completes
    except zmq.Again:
        pass  # no peer to queue for: nothing to inject either


# ------------------------------------------------------------------------------ the link alone


def test_only_the_engines_key_completes_a_handshake():
    """The ZAP check: a client that knows the frontend's public key but has a keypair of its
    own neither receives requests nor delivers messages; the engine's key does both."""

    async def run() -> None:
        server = LinkServer()
        ctx = zmq.Context()
        try:
            assert stat.S_IMODE(os.stat(server.dir).st_mode) == 0o700
            link = server.link
            own = link.connect(ctx, zmq.PUSH, link.from_engine)
            public, secret = zmq.curve_keypair()
            impostor = replace(link, public_key=public, secret_key=secret)
            bad_push = impostor.connect(ctx, zmq.PUSH, link.from_engine)
            bad_pull = impostor.connect(ctx, zmq.PULL, link.to_engine)
            good_pull = link.connect(ctx, zmq.PULL, link.to_engine)
            send_or_drop(bad_push, b"impostor")
            own.send(b"engine")
            assert await server.inp.poll(5000) and await server.inp.recv() == b"engine"
            assert await server.inp.poll(500) == 0  # the impostor's message never arrives
            await server.out.send(b"hello")  # wait for the engine's PULL to be attached
            assert good_pull.poll(5000) and good_pull.recv() == b"hello"
            for i in range(20):  # round-robin over attached peers: all go to the engine
                await server.out.send(b"%d" % i)
            assert [good_pull.recv() for _ in range(20)] == [b"%d" % i for i in range(20)]
            assert bad_pull.poll(500) == 0
        finally:
            ctx.destroy(linger=0)
            server.close()
        assert not os.path.exists(server.dir)

    asyncio.run(asyncio.wait_for(run(), 30))


def test_the_engine_exits_at_once_if_its_frontend_died_before_the_watch_was_set():
    """The race PR_SET_PDEATHSIG leaves open: the parent gone before prctl ran. The engine
    checks its parent right after; it returns before touching the config (None here)."""
    server = LinkServer()
    try:
        spawn = multiprocessing.get_context("spawn")
        not_my_parent = os.getppid()  # the engine's parent is this process, not ours
        proc = spawn.Process(target=run_engine_core, args=(None, server.link, not_my_parent))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        server.close()


def test_the_engine_is_killed_with_its_parent_even_inside_a_long_call():
    """PR_SET_PDEATHSIG, not the loop's getppid check: the grandchild sits in one long C call
    (a step would) when its parent is killed, and is gone within 2 s."""
    grandchild = (
        "import time; from atom_core.engine.core_process import _die_with_parent; "
        "_die_with_parent(); print('ready', flush=True); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
        "stdout=subprocess.PIPE, text=True); "
        "assert p.stdout.readline() == 'ready\\n'; print(p.pid, flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "the grandchild did not start"
        pid = int(proc.stdout.readline())
        assert not is_dead(pid)
        proc.kill()
        t = time.monotonic()
        while not is_dead(pid) and time.monotonic() - t < 5:
            time.sleep(0.02)
        assert is_dead(pid) and time.monotonic() - t < 2
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ------------------------------------------------------------------------------ real servers


@pytest.mark.slow
def test_a_foreign_process_on_the_engine_link_gets_nothing_and_injects_nothing(server, http):
    """Foreign peers on both endpoints, with no security and with CURVE keys of their own:
    they receive no request while requests are served, and a shutdown, a request and an
    engine failure sent through them change nothing."""
    path = link_dir(server.proc.pid)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.getuid()
    [engine] = server.engine_pids()
    to_engine, from_engine = f"ipc://{path / 'to-engine'}", f"ipc://{path / 'from-engine'}"
    ctx = zmq.Context()
    try:
        pulls = [foreign_socket(ctx, zmq.PULL, to_engine, curve) for curve in (False, True)]
        for curve in (False, True):
            to = foreign_socket(ctx, zmq.PUSH, to_engine, curve)
            injected = AddRequest("injected", [1, 2, 3], SamplingParams(max_tokens=4))
            send_or_drop(to, encoder.encode(injected))
            send_or_drop(to, encoder.encode(Control("shutdown")))
            back = foreign_socket(ctx, zmq.PUSH, from_engine, curve)
            send_or_drop(back, encoder.encode(EngineFailed("injected")))
        time.sleep(1.0)  # handshakes are attempted (and refused) within milliseconds
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: complete(server.base_url, f"request {i}", 16), range(8)))
        assert [o["usage"]["completion_tokens"] for o in outs] == [16] * 8
        assert all(pull.poll(500) == 0 for pull in pulls)
        assert http.get("/health").status_code == 200
        assert server.engine_pids() == [engine] and not is_dead(engine)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_two_servers_on_the_same_port_serve_their_own_requests(start_server):
    """``--port`` does not name a shared endpoint: two servers given the same one both
    start, and each answers its own requests (a request sent to the other engine would
    never finish here). Each link directory is removed when its server stops."""
    flags = (*SERVER_FLAGS, "--port", "23456")
    a, b = start_server(*flags, ready=False), start_server(*flags, ready=False)
    a.wait_ready()
    b.wait_ready()
    dir_a, dir_b = link_dir(a.proc.pid), link_dir(b.proc.pid)
    assert dir_a != dir_b
    jobs = [(a, f"alpha {i}", 12) for i in range(3)] + [(b, f"beta {i}", 20) for i in range(3)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda job: complete(job[0].base_url, job[1], job[2]), jobs))
    assert [o["usage"]["completion_tokens"] for o in outs] == [12] * 3 + [20] * 3
    # Greedy on the same weights: each server's answer is the other's for the same prompt.
    answer = complete(b.base_url, "alpha 0", 12)["choices"][0]["text"]
    assert answer == outs[0]["choices"][0]["text"]
    for srv in (a, b):
        text = httpx.get(f"{srv.base_url}/metrics").text
        served = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("atom:request_success_total{"))
        assert served == (3 if srv is a else 4)
    [engine_b] = b.engine_pids()
    a.stop()
    assert not dir_a.exists()
    assert dir_b.is_dir() and not is_dead(engine_b)
    assert complete(b.base_url, "still here", 4)["usage"]["completion_tokens"] == 4
    b.stop()
    assert not dir_b.exists()


@pytest.mark.slow
def test_the_engine_dies_within_2s_of_a_kill_9_of_its_frontend_under_load(start_server):
    """Four streams decoding (long max_tokens, ignore_eos) when the frontend is killed:
    every stream is cut, and the engine process is gone within 2 s."""
    # The tiny model's longest context: its decode must outlast the kill's scheduling on a
    # loaded 2-core machine (at 240 tokens all four streams once ended first).
    srv: ServerProcess = start_server(*SERVER_FLAGS, "--max-model-len", "512")
    [engine] = srv.engine_pids()
    path = link_dir(srv.proc.pid)
    started = threading.Barrier(5)
    body = {"model": "tiny", "prompt": "go", "max_tokens": 500, "ignore_eos": True, "stream": True}

    def stream() -> bool:
        """Whether the stream was cut (no [DONE])."""
        try:
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, headers=AUTH,
                              timeout=60) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                started.wait(60)
                return "data: [DONE]" not in lines
        except httpx.TransportError:
            return True  # the frontend was killed under it

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream) for _ in range(4)]
        started.wait(60)  # every stream has its first token: the engine is decoding
        os.kill(srv.proc.pid, signal.SIGKILL)
        t = time.monotonic()
        while not is_dead(engine) and time.monotonic() - t < 10:
            time.sleep(0.02)
        waited = time.monotonic() - t
        cut = [s.result(timeout=60) for s in streams]
    srv.proc.wait(10)
    shutil.rmtree(path, ignore_errors=True)  # nobody was left to remove it
    assert cut == [True] * 4, "a stream finished before the kill: not under load"
    assert is_dead(engine), "the engine outlived its frontend by 10 s"
    assert waited < 2.0, f"the engine took {waited:.2f} s to die"
