"""Ranks 1..N-1 of a tensor-parallel engine on this machine, as child processes of the
engine (rank 0).

Rank 0 schedules; every step it sends the scheduled batch to each worker, and all ranks
run the same model runner on it, so their collectives meet in the same order (rank 0's
sampled tokens are the ones kept). The command channel is each worker's stdin, pickled
messages with a length prefix: a worker waits on it between steps for as long as the
engine idles, and reads end-of-file (then exits) when the engine's process is gone, so no
worker outlives it. A worker that dies is seen at the next send, or by the collective it
leaves its peers waiting in, and the engine fails with the rank and its exit code.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
from typing import IO, Any

from atom_core.errors import EngineDeadError

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")


def write_message(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message; EOFError when the writer is gone."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankWorkers:
    """Start ranks 1..size-1 for ``config`` (each runs ``atom_core.distributed.worker``)."""

    def __init__(self, config: Any, size: int, expert_parallel: bool) -> None:
        self.size = size
        self.expert_parallel = expert_parallel
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([sys.executable, "-m", "atom_core.distributed.worker"],
                                        stdin=subprocess.PIPE, env=os.environ.copy())
                self.procs.append(proc)
                self.send_to(rank, (rank, size, self.init_method, config, expert_parallel))
        except BaseException:
            self.close()
            raise

    def send_to(self, rank: int, message: Any) -> None:
        proc = self.procs[rank - 1]
        try:
            write_message(proc.stdin, message)
        except (BrokenPipeError, OSError, ValueError):
            self.check()
            raise EngineDeadError(f"tensor-parallel rank {rank} stopped reading") from None

    def send(self, message: Any) -> None:
        """``message`` to every worker, in rank order."""
        self.check()
        for rank in range(1, self.size):
            self.send_to(rank, message)

    def check(self) -> None:
        """EngineDeadError naming the first worker that exited."""
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                raise EngineDeadError(f"tensor-parallel rank {rank} died (exit code {code})")

    def close(self, timeout: float = 10.0) -> None:
        """Ask every worker to stop, and end those that do not."""
        for proc in self.procs:
            try:
                write_message(proc.stdin, None)
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not stop; killing it",
                               proc.pid)
                proc.kill()
                proc.wait()
        self.procs = []
