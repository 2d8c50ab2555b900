"""The package's public names: the programmatic API at the top level, loaded on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import atom_core
from atom_core.engine.llm_engine import LLMEngine as EngineClass
from atom_core.sampling_params import SamplingParams as ParamsClass


def test_engine_and_sampling_params_import_from_the_package():
    from atom_core import LLMEngine, SamplingParams

    assert LLMEngine is EngineClass and SamplingParams is ParamsClass
    assert {"LLMEngine", "SamplingParams"} <= set(atom_core.__all__) <= set(dir(atom_core))


def test_importing_the_package_loads_neither_torch_nor_the_engine():
    check = (
        "import sys, atom_core, atom_core.hookspecs, atom_core.testing\n"
        "heavy = {'torch', 'transformers', 'atom_core.engine'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "from atom_core import LLMEngine\n"
        "assert 'atom_core.engine.llm_engine' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="'LLM'"):
        atom_core.LLM  # noqa: B018
