"""server_process's /proc readings: the CPU seconds of a process and the processes below
it, which the serving bench reads around each level and the DP test around its requests."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from atom_core.entrypoints.server_process import ServerProcess, cpu_seconds, descendant_pids

BUSY_S = 0.3
# A child that spins for BUSY_S of CPU, starts a grandchild that waits, then waits itself.
CHILD = (
    "import subprocess, sys, time\n"
    f"t = time.process_time()\nwhile time.process_time() - t < {BUSY_S}: pass\n"
    "g = subprocess.Popen([sys.executable, '-c', 'input()'], stdin=subprocess.PIPE)\n"
    "print(g.pid, flush=True)\ninput()\ng.communicate(b'\\n')\n"
)


def test_cpu_seconds_and_descendants_of_a_busy_child():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())  # printed after the busy spell
        assert cpu_seconds(child.pid) >= BUSY_S - 0.01
        assert cpu_seconds(grandchild) < BUSY_S / 2  # it only waits
        below = descendant_pids(os.getpid())
        assert child.pid in below and grandchild in below
        assert descendant_pids(child.pid) == [grandchild]
    finally:
        child.communicate("\n", timeout=30)
    deadline = time.monotonic() + 10
    while cpu_seconds(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cpu_seconds(child.pid) == 0.0  # gone
    assert child.pid not in descendant_pids(os.getpid())


def test_a_command_of_ones_own_gets_the_server_flags(tmp_path):
    """``command`` replaces the ``python -c`` launcher (bench/server_start.py passes
    ``atom serve``); the flags after it are the same."""
    log = tmp_path / "argv.log"
    echo = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]
    server = ServerProcess("some-model", "--max-model-len", "64", log=log, command=echo)
    assert server.proc.wait(30) == 0
    server.stop()
    assert log.read_text().strip() == str([
        "--host", "127.0.0.1", "--server-port", str(server.port), "--max-model-len", "64",
        "--disable-uvicorn-access-log", "--model", "some-model"])
