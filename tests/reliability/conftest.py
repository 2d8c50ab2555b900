"""A real ``atom serve`` subprocess on a tiny random Llama, shared by the reliability tests.

``server`` is one server for the whole session, started with an API key and the operator
limits the tests probe (what each flag is set to is in ``SERVER_FLAGS``); tests that kill or
signal a server start their own through ``start_server``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from atom_core.entrypoints.server_process import ServerProcess
from atom_core.testing.tiny_models import tiny_model_dir

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
SERVER_FLAGS: tuple[str, ...] = (
    "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", "--api-key", API_KEY,
    "--timeout-header-read", "3",
)


@pytest.fixture(scope="session")
def start_server(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(*flags)``: a ready server on the tiny Llama, stopped at session end
    (or earlier by the test); its log is ``srv.log()``."""
    started: list[ServerProcess] = []

    def start(*flags: str, ready: bool = True) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        srv = ServerProcess(tiny_model_dir("llama"), *flags, log=log)
        started.append(srv)
        return srv.wait_ready() if ready else srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def server(start_server, tmp_path_factory) -> ServerProcess:
    traces = tmp_path_factory.mktemp("traces")  # what /start_profile records goes here
    return start_server(*SERVER_FLAGS, "--torch-profiler-dir", str(traces))


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    """An httpx client on the shared server, with the API key."""
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client
