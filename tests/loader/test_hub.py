"""``--model owner/name``: a Hugging Face repo id resolved through huggingface_hub's cache,
here a cache prepared on disk and read offline (``HF_HUB_OFFLINE``), as a machine without
network would; ``atom serve MODEL`` positionally, the repo id as the served name."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import huggingface_hub.constants
import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.entrypoints.server_process import ServerProcess
from atom_core.errors import ConfigError
from atom_core.loader.hub import is_repo_id, resolve_model
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir

REPO = "atom-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def hub_cache(root: Path, repo: str = REPO) -> Path:
    """A huggingface_hub cache holding ``repo`` at COMMIT, on branch main: the layout
    ``snapshot_download`` leaves (refs/main names the snapshot)."""
    entry = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(tiny_model_dir("llama"), entry / "snapshots" / COMMIT)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    return root


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_repo_id_resolves_to_its_cached_snapshot(tmp_path, offline):
    cache = hub_cache(tmp_path)
    path = resolve_model(REPO, download_dir=str(cache))
    assert Path(path) == cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert resolve_model(REPO, revision="main", download_dir=str(cache)) == path
    local = str(tiny_model_dir("llama"))
    assert resolve_model(local) == local and resolve_model(None) is None
    assert is_repo_id(REPO) and not is_repo_id(local) and not is_repo_id("model.gguf")


def test_an_engine_on_a_repo_id_generates_what_the_directory_does(tmp_path, offline):
    cache = hub_cache(tmp_path)
    opts = dict(device="cpu", enable_log_stats=False)
    want = LLMEngine(str(tiny_model_dir("llama")), **opts).generate(["hub"], GREEDY)
    got = LLMEngine(REPO, download_dir=str(cache), **opts).generate(["hub"], GREEDY)
    assert got[0]["token_ids"] == want[0]["token_ids"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="atom-test/not-cached"), "not in the Hugging Face cache"),
    (dict(model=REPO, revision="v9"), "not in the Hugging Face cache"),
    (dict(model=None, revision="main"), "--revision applies to a Hugging Face repo id"),
])
def test_what_cannot_be_resolved_is_one_error(tmp_path, offline, kwargs, message):
    cache = hub_cache(tmp_path)
    with pytest.raises(ConfigError, match=message):
        resolve_model(kwargs["model"], kwargs.get("revision"), str(cache))


@pytest.mark.slow
def test_atom_serve_takes_the_repo_id_positionally(tmp_path, offline):
    cache = hub_cache(tmp_path / "hub")
    srv = ServerProcess(None, REPO, "--download-dir", str(cache), "--device", "cpu",
                        "--max-model-len", "128", log=tmp_path / "server.log").wait_ready()
    try:
        models = httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        body = {"model": REPO, "prompt": "hub", "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
