#!/usr/bin/env bash
# The headline on a CUDA host as a user types it: `make venv` (the CUDA stack, from a folder of wheels where the
# host has no package index), then `make quantize` and `make register` on Qwen2.5-7B-shaped recipes, eval and vLLM's
# CUDA smoke-load on. Each step is timed; its output goes to $OUT/log.txt and a summary to $OUT/summary.json.
#
#   WHEELS=/path/to/wheels OUT=/some/dir bash bench/gpu_make_headline.sh        # from the repository root
#
# STEPS (default "venv small awq gptq small-ct ct"; awq64 adds an AWQ g64 7B artifact, quantized only, for
# bench/seed_table.py), in the order given: venv installs; small and small-ct quantize the
# shipped smollm2-awq-g64 (the default recipe) and smollm2-gptq-ct-asym-g64 on the real SmolLM2-135M; awq / gptq / ct
# quantize AWQ g128, GPTQ g128 and GPTQ g128 in the compressed-tensors format on a random-init checkpoint of the 7B
# shape (bench/build_checkpoint.py). Each is registered after. No 4-bit copy of random weights follows their
# near-chaotic next-token choices, so the 7B runs' quality gates are off (KL, top-1, and the smoke's agreement with
# FP16); perplexity, the smoke-load, its kernel check and its agreement with our own decoding stand.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-make-headline}
WORK=${WORK:-/tmp/gpu-make-headline-work}
STEPS=" ${STEPS:-venv small awq gptq small-ct ct} "
mkdir -p "$OUT" "$WORK/r"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
: > "$WORK/steps.tsv"
step() {  # step LABEL command...: wall seconds and exit code into $WORK/steps.tsv
    local label=$1; shift
    echo "=== step $label: $*"
    local t0 t1 rc; t0=$(date +%s.%N); "$@"; rc=$?; t1=$(date +%s.%N)
    local s; s=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b - a}')
    echo "=== step $label: exit $rc in $s s"; printf '%s\t%s\t%s\n' "$label" "$rc" "$s" >> "$WORK/steps.tsv"
}
[[ "$STEPS" == *" venv "* ]] && step venv make venv ${WHEELS:+WHEELS=$WHEELS}
.venv/bin/python -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
NOGATE="eval: {max_kl: null, min_top1: null, vllm: {min_token_agreement: null}}"
recipe() {  # recipe NAME BASE [extra yaml line] -> $WORK/r/NAME.yaml on the 7B-shaped checkpoint
    printf 'name: %s\nbase: %s\nmodel: %s\n%s\n%s\n' "$1" "$(pwd)/recipes/$2.yaml" "$WORK/ckpt-7b" "$NOGATE" "${3:-}" \
        > "$WORK/r/$1.yaml"
}
recipe gpu-qwen7b-awq-g128 qwen7b-awq-g128
recipe gpu-qwen7b-gptq-g128 qwen7b-gptq-g128
recipe gpu-qwen7b-ct-g128 qwen7b-gptq-g128 "format: compressed-tensors"
recipe gpu-qwen7b-awq64-g64 qwen7b-awq-g128 "q_group_size: 64"
for s in $STEPS; do
    case $s in
        venv) continue;;
        small) r=smollm2-awq-g64; name=$r;;
        small-ct) r=smollm2-gptq-ct-asym-g64; name=$r;;
        awq64) name=gpu-qwen7b-awq64-g64; r="$WORK/r/$name.yaml"  # the seed table's g64 row: quantized only
            step "$s" .venv/bin/python -m pipeline run "$r" --force --no-eval; continue;;
        awq|gptq|ct) name=gpu-qwen7b-$s-g128; r="$WORK/r/$name.yaml"
            [ -d "$WORK/ckpt-7b" ] || step build .venv/bin/python bench/build_checkpoint.py --config bench/configs/qwen2.5-7b \
                --out "$WORK/ckpt-7b";;
        *) echo "error: STEPS names '$s'; use venv, small, small-ct, awq, gptq, ct or awq64" >&2; exit 2;;
    esac
    step "$s" make quantize RECIPE="$r" FORCE=1
    step "$s-register" make register RECIPE="$r"
    cp "artifacts/$name/report.json" "$OUT/$s-report.json" 2>/dev/null
    cp "artifacts/$name/report.md" "$OUT/$s-report.md" 2>/dev/null
    cp "artifacts/$name/README.md" "$OUT/$s-card.md" 2>/dev/null
done
.venv/bin/python - "$WORK/steps.tsv" "$OUT" <<'PY'
import json, sys
from pathlib import Path
rows = {l.split("\t")[0]: {"exit": int(l.split("\t")[1]), "wall_s": float(l.split("\t")[2])}
        for l in Path(sys.argv[1]).read_text().splitlines()}
out = Path(sys.argv[2])
for s in ("small", "small-ct", "awq", "gptq", "ct"):  # awq64 is quantized only
    f = out / f"{s}-report.json"
    if f.is_file() and s in rows:
        r = json.loads(f.read_text()); sm = r.get("vllm_smoke") or {}
        keys = ("passed", "skipped", "errors", "kernels", "kernel_check", "load_s", "token_agreement",
                "decode_agreement", "vllm_version", "checks", "memory", "capacity_check")
        rows[s]["report"] = {"passed": r.get("passed"),
                             "timings_s": {"quantize": r.get("quantize_timings_s"), "eval": r.get("eval_timings_s")},
                             "smoke": {k: sm.get(k) for k in keys}}
(out / "summary.json").write_text(json.dumps(rows, indent=1))
print(json.dumps(rows, indent=1))
PY
