#!/usr/bin/env bash
# Peer venv for ModelCloud's GPTQModel (bench/peers/gptqmodel_quant.py), separate from .venv: gptqmodel 7.7.0
# requires torch>=2.14.1 and transformers>=5.20.2, newer than the project's pins.
#
#   bash bench/peers/setup_gptqmodel.sh            # creates .cache/venv-gptqmodel if missing
#   HF_HUB_OFFLINE=1 .cache/venv-gptqmodel/bin/python bench/peers/gptqmodel_quant.py --help
#
# gptqmodel 7.7.0 is on the index as a pure-Python sdist (1.6 MB; its kernels compile on first use through
# ninja, and GPTQ quantization itself needs none of them). The index's torch 2.14.1 for Linux x86_64 is the CUDA
# build (with its nvidia-* wheels); it runs on a CPU-only host, and no CPU build of 2.14.x is on the index.
# Re-running re-checks the pins.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh" gptqmodel

"${PIP[@]}" install -q "torch==2.14.1"
"${PIP[@]}" install -q "torch==2.14.1" gptqmodel==7.7.0

drop_media_packages

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as m
import torch, transformers, gptqmodel
print(f"venv ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"gptqmodel {m.version('gptqmodel')}")
PYEOF
