import importlib.util
import os

# The example plugin is a separate distribution; test_writing_a_plugin.py installs it and
# runs its own tests in a subprocess, as its author would.
collect_ignore = ["example_plugin"]

# Without a GPU, Triton kernels can only run through its interpreter, and triton.jit reads
# the switch when a kernel module is imported: set it before any test imports atom_core.
if importlib.util.find_spec("triton") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
