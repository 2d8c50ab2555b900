import atexit
import importlib.util
import os
import shutil
import tempfile

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
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
