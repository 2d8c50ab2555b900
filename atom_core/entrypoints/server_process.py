"""``atom serve`` in a subprocess of its own process group: what end-to-end tests and the
serving benches (bench/serving_overhead.py, bench/serving_gpu.py) start and stop, and the
CPU time its processes use. Readiness is polled on
``/health`` with the standard library, so nothing beyond the server's own dependencies is
needed."""

from __future__ import annotations

import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

SERVE = "import sys; from atom_core.entrypoints.server_runtime import main; sys.exit(main())"


def free_port() -> int:
    """A free port on 127.0.0.1 below Linux's ephemeral range (32768 on): a client polling
    a port there before the server listens can be handed that very port as its own source
    and connect to itself, reading its request back."""
    for _ in range(200):
        p = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port")


def socket_inodes(pid: int) -> set[str]:
    """The inodes of process ``pid``'s open sockets (/proc), to find what it listens on in
    /proc/net/tcp or /proc/net/unix."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def cpu_seconds(pid: int) -> float:
    """CPU seconds (all threads, ended ones included) process ``pid`` has used; 0.0 once it
    is gone. Read from the process's CPU-time clock, to the nanosecond: /proc's tick counts
    (10 ms) round a short benchmark level's frontend time to zero."""
    try:
        return time.clock_gettime(_process_cpu_clock(pid))
    except OSError:
        return 0.0


def _process_cpu_clock(pid: int) -> int:
    # Linux's clock id for another process's CPU time (clock_getcpuclockid(3)): the pid's
    # complement shifted past the three clock-type bits, 2 = CPUCLOCK_SCHED, whole process.
    return ((~pid) << 3) | 2


def descendant_pids(pid: int) -> list[int]:
    """Every process below ``pid``: a server's engine processes, their tensor-parallel
    workers, multiprocessing's helpers."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread or the process ended meanwhile
        for kid in kids:
            out += [kid, *descendant_pids(kid)]
    return out


class ServerProcess:
    """``stop()`` ends the whole group (frontend and engine process). ``access_log``: a
    log line per HTTP request (off: the tests' servers answer thousands)."""

    def __init__(self, model: str | Path | None, *extra: str, log: Path | None = None,
                 access_log: bool = False, command: Sequence[str] | None = None) -> None:
        """``command``: what runs ``atom serve`` (``["atom", "serve"]``, say); by default
        ``python -c`` - not -m: multiprocessing's spawn imports a -m main module again in
        every engine and tensor-parallel process, and this one brings the whole HTTP stack
        (~0.4 s each)."""
        self.port = free_port()
        launcher = list(command) if command is not None else [sys.executable, "-c", SERVE]
        args = [*launcher, "--host", "127.0.0.1", "--server-port", str(self.port), *extra]
        if not access_log:
            args.append("--disable-uvicorn-access-log")
        if model is not None:
            args += ["--model", str(model)]
        self.log_path = log
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self._out = out
        self.proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass  # not listening yet, or the engine is still loading
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path else ""

    def engine_pids(self) -> list[int]:
        """Children of the server running multiprocessing's spawn_main (the engine process)."""
        pgrep = ["pgrep", "-P", str(self.proc.pid)]
        out = subprocess.run(pgrep, capture_output=True, text=True).stdout
        pids = []
        for pid in map(int, out.split()):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                pids.append(pid)
        return pids

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._out is not subprocess.DEVNULL:
            self._out.close()
