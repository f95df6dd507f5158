#!/usr/bin/env bash
# The headline command on a GPU host, end to end with eval on, timed from interpreter start to report written:
# `python -m pipeline run` of the shipped qwen7b AWQ g128 and GPTQ g128 recipes on a Qwen2.5-7B-shaped
# random-init checkpoint (bench/build_checkpoint.py), perplexity over the whole bundled WikiText-2 test text.
#
#   OUT=/some/dir bash bench/gpu_headline.sh      # on the GPU host, from the repository root
#
# Steps (each timed, each one's output in $OUT/log.txt; a failing step does not stop the next):
#   tiny    the same recipes' code paths on a 2-layer checkpoint (seconds; a broken path shows here cheaply)
#   awq     the AWQ g128 run, empty reference cache (the reference model is scored)
#   eval    `python -m pipeline eval` again on that artifact (the reference's perplexity from the cache)
#   reg     `python -m pipeline register` on it: refused while vLLM never loaded it
#   gptq    the GPTQ g128 run, reference cached by the AWQ run (same model, protocol, dtype, GPU)
#   gptq0   the GPTQ g128 run again with the cache emptied (--force)
# STEPS="awq gptq0" runs only those (default: all; the checkpoint is built, or reused, in any case).
# $OUT gets log.txt, summary.json (per step: seconds, exit code, the report's key figures) and each 7B
# run's report.json and model card.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=" ${STEPS:-tiny awq eval reg gptq gptq0} "
for s in $STEPS; do
    case " tiny awq eval reg gptq gptq0 " in *" $s "*) ;; *) echo "error: STEPS names '$s'; use tiny, awq, eval, reg, gptq or gptq0" >&2; exit 2;; esac
done
OUT=${OUT:-/tmp/gpu-headline}
WORK=${WORK:-/tmp/gpu-headline-work}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK/r"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 QUANTIZE_CACHE_DIR="$WORK/cache"
exec > >(tee -a "$OUT/log.txt") 2>&1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nproc; free -g | head -2

recipe() {  # recipe NAME BASE MODEL [extra yaml] -> $WORK/r/NAME.yaml
    printf 'name: %s\nbase: %s\nmodel: %s\n%s\n' "$1" "$ROOT/recipes/$2.yaml" "$3" "${4:-}" > "$WORK/r/$1.yaml"
}
ROOT=$(pwd)
step() {  # step LABEL command... : wall seconds and exit code into $WORK/steps.tsv (only the steps in $STEPS)
    local label=$1; shift
    if [ "$label" != build ] && [[ "$STEPS" != *" $label "* ]]; then echo "=== step $label: not in STEPS"; return; fi
    echo "=== step $label: $*"
    local t0 t1 rc
    t0=$(date +%s.%N); "$@"; rc=$?; t1=$(date +%s.%N)
    local s; s=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b - a}')
    echo "=== step $label: exit $rc in $s s"
    printf '%s\t%s\t%s\n' "$label" "$rc" "$s" >> "$WORK/steps.tsv"
}
: > "$WORK/steps.tsv"

$PY bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --tiny --out "$WORK/ckpt-tiny"
# random-init weights give nearly flat next-token distributions: KL and top-1 are measured (their cost is part of
# the eval stage's time) but not gated
NOGATE="max_kl: null, min_top1: null"
recipe tiny-awq qwen7b-awq-g128 "$WORK/ckpt-tiny" "eval: {perplexity: {max_windows: 8}, $NOGATE}"
step tiny $PY -m pipeline run "$WORK/r/tiny-awq.yaml" --out "$WORK/art" --force

step build $PY bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --out "$WORK/ckpt-7b"
CKPT_BYTES=$(du -sb "$WORK/ckpt-7b" | cut -f1)
recipe h200-qwen7b-awq-g128 qwen7b-awq-g128 "$WORK/ckpt-7b" "eval: {$NOGATE}"
recipe h200-qwen7b-gptq-g128 qwen7b-gptq-g128 "$WORK/ckpt-7b" "eval: {$NOGATE}"
A="$WORK/art/h200-qwen7b-awq-g128" G="$WORK/art/h200-qwen7b-gptq-g128"

step awq $PY -m pipeline run "$WORK/r/h200-qwen7b-awq-g128.yaml" --out "$WORK/art" --force
[ -f "$A/report.json" ] && cp "$A/report.json" "$OUT/awq-report.json" && cp "$A/README.md" "$OUT/awq-model-card.md"
step eval $PY -m pipeline eval "$WORK/r/h200-qwen7b-awq-g128.yaml" --artifact "$A"
step reg $PY -m pipeline register --artifact "$A"
step gptq $PY -m pipeline run "$WORK/r/h200-qwen7b-gptq-g128.yaml" --out "$WORK/art" --force
[ -f "$G/report.json" ] && cp "$G/report.json" "$OUT/gptq-report.json" && cp "$G/README.md" "$OUT/gptq-model-card.md"
rm -rf "$WORK/cache/reference-ppl"
step gptq0 $PY -m pipeline run "$WORK/r/h200-qwen7b-gptq-g128.yaml" --out "$WORK/art" --force
[ -f "$G/report.json" ] && cp "$G/report.json" "$OUT/gptq-cold-report.json"

$PY - "$WORK/steps.tsv" "$OUT" "$CKPT_BYTES" <<'EOF'
import json, sys
from pathlib import Path
steps, out, ckpt = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
rows = {l.split("\t")[0]: {"exit": int(l.split("\t")[1]), "wall_s": float(l.split("\t")[2])}
        for l in Path(steps).read_text().splitlines()}
for label, f in (("awq", "awq-report.json"), ("gptq", "gptq-report.json"), ("gptq0", "gptq-cold-report.json")):
    p = out / f
    if p.is_file() and label in rows:
        r = json.loads(p.read_text())
        s = r.get("scored_on", {})
        rows[label].update(ppl=r["perplexity"]["fp16"]["ppl"], ppl_q=r["perplexity"]["quantized"]["ppl"],
                           windows=r["perplexity"]["protocol"]["windows"], passed=r["passed"],
                           smoke=r["vllm_smoke"], scored_on=s, quantize_s=r["quantize_timings_s"],
                           eval_s=r["eval_timings_s"],
                           rss_over_ckpt=(s.get("host_rss_peak_bytes") or 0) / ckpt)
summary = {"checkpoint_bytes": ckpt, "steps": rows}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=1))
EOF
