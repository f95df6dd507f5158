#!/usr/bin/env bash
# Peer venv for Intel's AutoRound (bench/peers/autoround_quant.py), separate from .venv so that its
# requirements never move the project's pins.
#
#   bash bench/peers/setup_autoround.sh            # creates .cache/venv-autoround if missing
#   HF_HUB_OFFLINE=1 .cache/venv-autoround/bin/python bench/peers/autoround_quant.py --help
#
# auto-round 0.16.1 is a pure-Python wheel (1.5 MB) declaring torch, transformers>=4.38, accelerate, datasets,
# pydantic; torch==2.13.0 resolves to the local CPU build (2.13.0+cpu) through pip's find-links, installed first
# and alone so nothing pulls a CUDA torch; transformers is pinned to the project's (5.19.0) so the peer reads the
# model exactly as our pipeline does. Its "cpu" extra (numba, tbb, auto-round-lib) only speeds up CPU inference
# of the exported model and is not installed. Re-running re-checks the pins.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh" autoround

"${PIP[@]}" install -q "torch==2.13.0"   # first, alone: the CPU build from find-links
"${PIP[@]}" install -q "torch==2.13.0" auto-round==0.16.1 transformers==5.19.0 accelerate==1.15.0 \
    datasets==5.2.0 safetensors

drop_media_packages

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as m
import torch, transformers, auto_round
assert not torch.version.cuda, f"CUDA torch installed: {torch.__version__}"
print(f"venv ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"auto-round {m.version('auto-round')}")
PYEOF
