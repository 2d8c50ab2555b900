import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest
import torch

# The example plugin is a separate distribution; test_writing_a_plugin.py installs it and
# runs its own tests in a subprocess, as its author would.
collect_ignore = ["example_plugin"]

# One GGUF header cache for the session (server tests' subprocesses inherit it): the first
# load of the embedded model parses its header, the rest read the entry; nothing is left in
# the user's ~/.cache.
if "ATOM_CACHE_DIR" not in os.environ:
    os.environ["ATOM_CACHE_DIR"] = tempfile.mkdtemp(prefix="atom-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ATOM_CACHE_DIR"], ignore_errors=True)

# Without a GPU, Triton kernels can only run through its interpreter, and triton.jit reads
# the switch when a kernel module is imported: set it before any test imports atom_core.
if importlib.util.find_spec("triton") is not None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' model of the embedded GGUF, fp32 (its GGUF load takes ~35 s on a 2-core
    VM: once a session, shared by the tests that compare against it)."""
    from transformers import AutoModelForCausalLM

    from atom_core.loader import embedded_model_path

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """``atom serve`` on the embedded model (no --model), --max-model-len 512, its access log
    on: one for the session, shared by the test modules that drive the real weights over HTTP
    (each start took 12-17 s on a 2-core VM). Its log is ``server.log_path``."""
    from atom_core.entrypoints.server_process import ServerProcess

    log = tmp_path_factory.mktemp("smollm2-server") / "server.log"
    srv = ServerProcess(None, "--max-model-len", "512", log=log, access_log=True).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smollm2_chunked():
    """The embedded SmolLM2, unquantized, prefilling in 32-token chunks (tests/perplexity.py's
    CHUNKED), and its perplexity of TEXT: the fp8 tests' baseline, built and scored once."""
    from atom_core.engine.llm_engine import LLMEngine
    from tests.perplexity import CHUNKED, TEXT, perplexity

    engine = LLMEngine(**CHUNKED)
    return engine, perplexity(engine, TEXT)


@pytest.fixture(scope="session")
def smollm2_engine():
    """An LLMEngine on the embedded SmolLM2 with --max-model-len 512 and otherwise the
    defaults, shared by the modules that use it so (no prefix cache: what one test ran
    leaves nothing that changes another's tokens)."""
    from atom_core.engine.llm_engine import LLMEngine

    return LLMEngine(enable_log_stats=False, device="cpu", max_model_len=512)
