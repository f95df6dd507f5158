#!/usr/bin/env bash
# Quality side by side on one real model: our AWQ recipes against AutoAWQ 0.2.9 and llm-compressor 0.14's AWQ,
# same model, same calibration token blocks (16 x 512 of the bundled pile mix, seed 0), same evaluator
# (eval/artifact.py decodes every artifact's packed tensors; held-out WikiText-2, 2048-token windows, fp32).
#
#   bash bench/quality_compare.sh RECIPE [WINDOWS] [SPLIT]     (defaults: 40 windows, split at 16)
#   e.g. bash bench/quality_compare.sh smollm2-awq-g64;  bash bench/quality_compare.sh gemma3-270m-awq-g64
#
# Ours, from RECIPE in one pass (bench/awq_variants.py: one scale search per layer shared by the variants):
#   classic  AutoAWQ's clip search (±max|w|) and round-to-nearest: no per-side clip, no scale refit
#   default  the recipe as shipped (quantize/recipe.py's AWQ defaults)
#   gptq     the default plus awq.rounding: gptq (the setting of recipes/smollm2-awq-gptq-g64.yaml)
# Peers (skipped when their environment is missing; one that fails on the model says so and gets no row): bash bench/peers/setup_autoawq.sh,
# bash bench/peers/setup_llmcompressor.sh. Perplexity of windows [0, SPLIT) and [SPLIT, WINDOWS) from one run:
# bench/results/quality-RECIPE.json. Gemma 3 needs bash bench/setup_gemma3.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RECIPE=$1; W=${2:-40}; SPLIT=${3:-16}
PY=${PY:-.venv/bin/python}
ART=${ART:-artifacts/quality}
AUTOAWQ_DIR=${AUTOAWQ_DIR:-.cache/autoawq-0.2.9}  # AutoAWQ's unpacked sdist (bench/peers/setup_autoawq.sh)
LLMC_PY=${LLMC_PY:-.cache/venv-llmcompressor/bin/python}  # a Python with llm-compressor 0.14
SCORE_DEVICE=${SCORE_DEVICE:-cpu}  # where every artifact is scored in float32 (cuda: the same protocol, faster)
read -r SPEC G < <($PY -c "from quantize.recipe import load_recipe as l; r = l('$RECIPE'); print(r.model, r.q_group_size)")
SRC=$($PY -c "from quantize.source import load as source; print(source.resolve('$SPEC').path)")
OURS=("$ART/$RECIPE-classic" "$ART/$RECIPE-default" "$ART/$RECIPE-gptq")
if [ ! -d "${OURS[2]}" ]; then
  $PY bench/awq_variants.py "$RECIPE" --out "$ART" classic:awq.clip_search=symmetric,awq.refit_iters=0 default: \
    gptq:awq.rounding=gptq
fi
PEERS=()
if [ -d "$AUTOAWQ_DIR/awq" ]; then
  [ -d "$ART/$RECIPE-autoawq" ] || PYTHONPATH=".:$AUTOAWQ_DIR:${PYTHONPATH:-}" $PY bench/peers/autoawq_quant.py \
    --model "$SRC" --out "$ART/$RECIPE-autoawq" --group-size "$G" || echo "AutoAWQ failed on $RECIPE: no row for it"
  [ -d "$ART/$RECIPE-autoawq" ] && PEERS+=("$ART/$RECIPE-autoawq")
fi
if command -v "$LLMC_PY" > /dev/null; then
  [ -d "$ART/$RECIPE-llmc-awq" ] || "$LLMC_PY" bench/peers/llmc_awq.py \
    --model "$SRC" --out "$ART/$RECIPE-llmc-awq" --group-size "$G" || echo "llm-compressor failed on $RECIPE: no row for it"
  [ -d "$ART/$RECIPE-llmc-awq" ] && PEERS+=("$ART/$RECIPE-llmc-awq")
fi
mkdir -p bench/results
$PY bench/ppl_compare.py --source "$SPEC" --max-windows "$W" --split "$SPLIT" --device "$SCORE_DEVICE" \
  --json "bench/results/quality-$RECIPE.json" "${OURS[@]}" "${PEERS[@]}"
