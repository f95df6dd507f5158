#!/usr/bin/env bash
# Wheels the GPU benchmark (bench/gpu_bench.py) needs on the lent GPU host beyond what its image holds.
#
#   bash bench/peers/collect_wheels.sh .whl            # Python 3.12 manylinux x86_64 (the GPU host)
#   PY_VERSION=3.11 bash bench/peers/collect_wheels.sh .cache/whl311   # same set for a local 3.11 test venv
#
# The host image (KINDS.md, 2026-11-17) already has torch 2.11, transformers 5.17, accelerate, safetensors,
# huggingface-hub, numpy, pandas, pyarrow, pyyaml, tqdm, requests, psutil, pillow, xxhash, filelock,
# nvidia-ml-py, packaging. What is missing:
# - our import chain with eval off (quantize.runner): pydantic (+ pydantic-core, annotated-types,
#   typing-inspection, typing-extensions >= 4.16 for pydantic 2.14) and compressed-tensors (imported by
#   quantize/formats/compressed_tensors.py through quantize.formats.pack, even when the recipe writes AWQ/GPTQ);
# - llm-compressor 0.14.0.1: compressed-tensors==0.19.0 (+ loguru), datasets (+ dill, multiprocess, and
#   fsspec <= 2026.9.0 as datasets 5.2 requires).
# One compressed-tensors serves both: our code only uses pack_to_int32/unpack_from_int32 and its config
# classes, which 0.19.0 has unchanged (checked: pack/unpack round trip and config under 0.19.0), so both
# runs share one install directory. Versions are those of bench/peers/requirements-llmcompressor.txt.
# auto-round (a Requires-Dist of llmcompressor) is left out: only llmcompressor.modifiers.autoround
# imports it, and neither AWQ nor GPTQ loads that module.
set -euo pipefail

DEST="${1:?usage: collect_wheels.sh TARGET_DIR (e.g. .whl)}"
PY_VERSION="${PY_VERSION:-3.12}"
PY="${PYTHON:-python3}"

WHEELS=(
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    compressed-tensors==0.19.0
    loguru==0.7.3
    llmcompressor==0.14.0.1
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    fsspec==2026.9.0
)

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "$spec"
done

# One version of each package: two of the same name stop `pip install --no-index` on the host.
dupes=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "error: $DEST holds more than one wheel of: $dupes; empty it and run again" >&2
    exit 1
fi
ls -1 "$DEST"
echo "total: $(du -ch "$DEST"/*.whl | tail -1 | cut -f1) in $(ls "$DEST"/*.whl | wc -l) wheels ($DEST)"
