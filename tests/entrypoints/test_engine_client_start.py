"""EngineClient starts the engine process before it loads the tokenizer; a start-up that
fails after that leaves no engine process behind."""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import time

import pytest

from atom_core.engine.arg_utils import EngineArgs
from atom_core.entrypoints.openai import engine_client
from atom_core.entrypoints.server_process import free_port
from atom_core.errors import ConfigError
from tests.tiny_models import tiny_model_dir


def config_for(model, *extra: str):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(model), "--port", str(free_port(2)), *extra])
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
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        engine_client.EngineClient(config_for(model, "--device", "cpu"))
    assert len(started) == 1
    assert not started[0].is_alive() and engines() == []


def test_a_failed_start_can_be_abandoned():
    """What the server's lifespan does when resolving the chat parser or waiting for the
    engine fails: the engine, possibly still loading, is killed and the ports freed."""
    config = config_for(tiny_model_dir("llama"), "--device", "cpu")
    client = engine_client.EngineClient(config)
    assert client.process.is_alive() and client.tokenizer is not None
    t = time.monotonic()
    client.abandon()
    assert not client.process.is_alive() and engines() == []
    assert time.monotonic() - t < 10
    again = engine_client.EngineClient(config)  # the same ports bind again
    again.abandon()
