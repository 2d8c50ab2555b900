"""EngineClient starts the engine process before it loads the tokenizer; a start-up that
fails after that leaves no engine process and no link directory behind."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from atom_core.engine import client as engine_client
from atom_core.engine.arg_utils import EngineArgs
from atom_core.errors import ConfigError
from atom_core.testing.tiny_models import tiny_model_dir


def config_for(model, *extra: str):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(model), *extra])
    return EngineArgs.from_cli_args(args).create_config()


def engines() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "atom-engine-core"]


def test_a_model_without_a_tokenizer_fails_and_kills_the_started_engine(tmp_path, monkeypatch):
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir("llama"), model)
    for f in model.glob("*token*"):
        f.unlink()
    started = []
    real = engine_client.load_tokenizer

    def load_tokenizer(config):
        started.extend(engines())  # the engine process is already running here
        return real(config)

    monkeypatch.setattr(engine_client, "load_tokenizer", load_tokenizer)
    links = []
    real_link = engine_client.LinkServer

    def link_server():
        links.append(real_link())
        return links[-1]

    monkeypatch.setattr(engine_client, "LinkServer", link_server)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        engine_client.EngineClient(config_for(model, "--device", "cpu"))
    assert len(started) == 1
    assert not started[0].is_alive() and engines() == []
    assert len(links) == 1 and not Path(links[0].dir).exists()


def test_a_failed_start_can_be_abandoned():
    """What the server's lifespan does when resolving the chat parser or waiting for the
    engine fails: the engine, possibly still loading, is killed and the link removed."""
    config = config_for(tiny_model_dir("llama"), "--device", "cpu")
    client = engine_client.EngineClient(config)
    [replica] = client.replicas
    link_dir = Path(replica.link.dir)
    assert replica.process.is_alive() and client.tokenizer is not None
    assert stat.S_IMODE(link_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in link_dir.iterdir()) == ["from-engine", "to-engine"]
    t = time.monotonic()
    client.abandon()
    assert not replica.process.is_alive() and engines() == []
    assert time.monotonic() - t < 10
    assert not link_dir.exists()
    again = engine_client.EngineClient(config)  # a fresh link of its own
    assert Path(again.replicas[0].link.dir) != link_dir
    again.abandon()


def test_the_engine_client_refuses_to_start_off_the_main_thread():
    """The engine process dies with the thread that started it (PR_SET_PDEATHSIG): started
    from a thread that ends, it would be killed under a live frontend."""
    errors: list[BaseException] = []

    def start() -> None:
        try:
            engine_client.EngineClient(config_for(tiny_model_dir("llama"), "--device", "cpu"))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "main thread" in str(errors[0]) and engines() == []


# Run in a fresh interpreter: which modules are loaded when `atom serve` starts the engine,
# and when it hands the engine its config.
SERVE_UNTIL_THE_ENGINE_STARTS = """
import sys
from atom_core.engine import client as engine_client
from atom_core.entrypoints import server_runtime

real_start, real_client = server_runtime.start_waiting_engines, server_runtime.EngineClient
HEAVY = ("torch", "transformers", "fastapi", "atom_core.entrypoints.http.app",
         "atom_core.engine.core_process")


def start(count):
    waiting = real_start(count)
    print("at the start:", [m for m in HEAVY if m in sys.modules], len(waiting))
    return waiting


def started(config, name, waiting):
    client = real_client(config, name, waiting)
    print("handed over:", [m for m in HEAVY if m in sys.modules],
          client.replicas[0].process is waiting[0].process, client.replicas[0].process.is_alive())
    client.abandon()
    raise SystemExit(0)


server_runtime.start_waiting_engines = start
server_runtime.EngineClient = started
server_runtime.main(["--model", sys.argv[1], "--device", "cpu"])
"""


def test_serve_starts_the_engine_before_it_imports_torch_or_the_http_stack():
    """The engine process imports torch and its own modules while the frontend checks the
    flags and the model; it loads the model while the frontend imports FastAPI and its
    routes. The frontend never imports the engine's modules."""
    out = subprocess.run([sys.executable, "-c", SERVE_UNTIL_THE_ENGINE_STARTS,
                          str(tiny_model_dir("llama"))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "at the start: [] 1" in out.stdout, out.stdout + out.stderr[-2000:]
    # torch and transformers: the model's checks and the tokenizer.
    assert "handed over: ['torch', 'transformers'] True True" in out.stdout, out.stdout


def test_a_waiting_engine_runs_the_config_it_is_handed():
    config = config_for(tiny_model_dir("llama"), "--device", "cpu")
    waiting = engine_client.start_waiting_engines(2)
    client = engine_client.EngineClient(config, waiting=waiting)
    try:
        [replica] = client.replicas
        assert replica.process is waiting[0].process
        assert not waiting[1].process.is_alive()  # one replica: the other one was stopped
        asyncio.run(asyncio.wait_for(client.start(), 120))
        assert replica.process.is_alive() and client.max_model_len > 0
    finally:
        client.abandon()
    assert engines() == []


def test_a_waiting_engine_exits_when_the_frontend_hands_it_nothing():
    """A frontend that stops before its engine has its config (killed, or its checks
    failed) closes its end of the pipe: the engine exits once its imports are done."""
    [engine] = engine_client.start_waiting_engines(1)
    engine.conn.close()
    engine.process.join(120)
    assert engine.process.exitcode == 0 and engines() == []


def test_a_waiting_engine_that_died_is_a_start_up_error():
    """An engine that died before its config came (an import that failed, a kill) is said
    as one ConfigError, not a broken pipe's traceback."""
    [engine] = engine_client.start_waiting_engines(1)
    engine.process.kill()
    engine.process.join(10)
    with pytest.raises(ConfigError, match=r"exited during start-up \(code -9\)"):
        engine_client.EngineClient(config_for(tiny_model_dir("llama"), "--device", "cpu"),
                                   waiting=[engine])
    assert engines() == []
