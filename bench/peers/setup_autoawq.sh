#!/usr/bin/env bash
# AutoAWQ 0.2.9 for bench/peers/autoawq_quant.py, without installing it: its pure-Python package `awq` is
# unpacked from the PyPI sdist into .cache/autoawq-0.2.9 and put on PYTHONPATH by the caller. It runs in the
# project's own .venv (torch 2.13 CPU, transformers 5.19): AutoAWQ's declared requirements (transformers>=4.45,
# torch) are met there, and its optional CUDA kernels are not needed to quantize or to save the GEMM layout.
#
#   bash bench/peers/setup_autoawq.sh [PYTHON]      # PYTHON: the venv's python (default .venv/bin/python)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
DEST="$ROOT/.cache/autoawq-0.2.9"
if [ ! -d "$DEST/awq" ]; then
    TMP=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --no-binary :all: autoawq==0.2.9 -d "$TMP"
    mkdir -p "$ROOT/.cache"
    tar xzf "$TMP"/autoawq-0.2.9.tar.gz -C "$ROOT/.cache"
    rm -rf "$TMP"
fi
PYTHONPATH="$DEST" "$PY" -c "import awq, importlib.metadata as m; from awq import AutoAWQForCausalLM; print('autoawq ok:', awq.__version__, '| transformers', m.version('transformers'))" 2>&1 | tail -1
