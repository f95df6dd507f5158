#!/usr/bin/env bash
# Quality side by side against AutoRound and GPTQModel: our recipe as shipped, AutoRound 0.16.1 (its default
# recipe, and its "best" recipe), GPTQModel 7.7.0 (its default GPTQ, and GPTAQ), all on the recipe's model, group
# size and grid (zero_point: true -> asymmetric, false -> symmetric), the same calibration token blocks (16 x 512
# of the bundled pile mix, seed 0), one run each; then every artifact decoded by eval/artifact.py and scored by
# bench/ppl_compare.py (held-out WikiText-2, 2048-token windows, float32) with KL and top-1 against the source.
#
#   bash bench/peer_quality.sh RECIPE [WINDOWS]         (default 16 windows: the eval stage's protocol)
#   e.g. bash bench/peer_quality.sh smollm2-awq-g64;  GROUP=128 bash bench/peer_quality.sh gemma3-270m-awq-g64
#
# Environment: GROUP overrides the recipe's group size (ours, with q_group_size=GROUP, and the peers');
# AR_ITERS overrides AutoRound's iterations per block (its default 200, best 1000) where the machine cannot
# afford them, and is recorded in the artifact's peer_run.json; AR_RECIPES (default "default best") and
# GPTQMODEL_VARIANTS (default "gptq gptaq") pick the peer runs. OURS_SET adds dotted recipe keys to our row (e.g.
# compute_dtype=float32 on a GPU host, where the recipe's auto computes in its 16-bit dtype and the peers in
# float32); it is part of our row's artifact name, and the group size and grid it sets (q_group_size, zero_point)
# are every row's. Peers need bash bench/peers/setup_autoround.sh
# and bash bench/peers/setup_gptqmodel.sh; one whose venv is missing is skipped, one that fails says so and
# gets no artifact (its error is in its log under ART). Record: bench/results/peer-quality-RECIPE-gG-GRID.json
# (G the group size, GRID asym or sym; OURS_SET is not in the name: a run with other keys overwrites it), or the
# path RECORD names (runs of one recipe and grid side by side, e.g. each AutoRound recipe in its own process).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
RECIPE=$1; W=${2:-16}
PY=${PY:-.venv/bin/python}
ART=${ART:-artifacts/quality}
AR_PY=${AR_PY:-.cache/venv-autoround/bin/python}
GM_PY=${GM_PY:-.cache/venv-gptqmodel/bin/python}
AR_RECIPES=${AR_RECIPES:-default best}
GPTQMODEL_VARIANTS=${GPTQMODEL_VARIANTS:-gptq gptaq}
SCORE_DEVICE=${SCORE_DEVICE:-cpu}
PEER_DEVICE=${PEER_DEVICE:-cpu}  # where the peers quantize (cuda on a GPU host)
OURS_SET=${OURS_SET:-}
# the model, group size and grid of our row's recipe (OURS_SET applied: e.g. zero_point=false gives every row the
# symmetric grid, q_group_size=128 every row g128)
read -r SPEC G ZP < <(OURS_SET=$OURS_SET $PY -c "import os; from bench.awq_variants import variant
from quantize.recipe import load_recipe as l; r = variant(l('$RECIPE'), 'row', os.environ['OURS_SET'])
print(r.model, r.q_group_size, r.zero_point)")
G=${GROUP:-$G}
SRC=$($PY -c "from quantize.source import load as source; print(source.resolve('$SPEC').path)")
SYM=(); GRID=asym
if [ "$ZP" = "False" ]; then SYM=(--sym); GRID=sym; fi
TAG="$RECIPE-g$G"
mkdir -p "$ART" bench/results
LABEL=default${OURS_SET:+-$(printf '%s' "$OURS_SET" | tr -c 'A-Za-z0-9' '-')}
SETS=$OURS_SET
if [ -n "${GROUP:-}" ]; then LABEL="g$G-$LABEL"; SETS="q_group_size=$G${OURS_SET:+,$OURS_SET}"; fi
OURS="$ART/$RECIPE-$LABEL"
if [ ! -d "$OURS" ]; then $PY bench/awq_variants.py "$RECIPE" --out "$ART" "$LABEL:$SETS"; fi
ROWS=("$OURS")
peer() {  # peer NAME PYTHON SCRIPT ARGS...: run once into $ART/$TAG-NAME, keep it as a row when it exists
  local name=$1 py=$2; shift 2
  local out="$ART/$TAG-$GRID-$name"
  if ! command -v "$py" > /dev/null; then echo "$name: $py missing (its setup script): skipped"; return; fi
  if [ ! -d "$out" ]; then
    "$py" "$@" --model "$SRC" --out "$out" --group-size "$G" --device "$PEER_DEVICE" "${SYM[@]}" > "$out.log" 2>&1 \
      || { echo "$name failed on $RECIPE: $(tail -1 "$out.log")"; rm -rf "$out"; return; }
  fi
  ROWS+=("$out")
}
for r in $AR_RECIPES; do
  peer "autoround-$r${AR_ITERS:+-i$AR_ITERS}" "$AR_PY" bench/peers/autoround_quant.py --recipe "$r" \
    ${AR_ITERS:+--iters "$AR_ITERS"}
done
for v in $GPTQMODEL_VARIANTS; do
  if [ "$v" = gptaq ]; then peer gptqmodel-gptaq "$GM_PY" bench/peers/gptqmodel_quant.py --gptaq
  else peer gptqmodel-gptq "$GM_PY" bench/peers/gptqmodel_quant.py; fi
done
$PY bench/ppl_compare.py --source "$SPEC" --max-windows "$W" --device "$SCORE_DEVICE" --distribution \
  --source-cache "$ART/.source-$(basename "$SRC")-w$W.pt" \
  --json "${RECORD:-bench/results/peer-quality-$TAG-$GRID.json}" "${ROWS[@]}"
