"""pdl_options: off for CPU tensors and when ATOM_PDL=0, so the interpreter and
non-Hopper devices never see a PDL launch."""

from __future__ import annotations

import torch
from atom_kernels_triton import pdl


def test_cpu_launches_never_use_pdl(monkeypatch):
    monkeypatch.setenv("ATOM_PDL", "1")
    pdl._options.cache_clear()
    assert pdl.pdl_options(torch.device("cpu")) == {"PDL": False}


def test_atom_pdl_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("ATOM_PDL", "0")
    pdl._options.cache_clear()
    try:
        assert pdl._options(0) == {"PDL": False}
    finally:
        pdl._options.cache_clear()
