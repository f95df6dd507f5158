#!/usr/bin/env bash
# The AWQ quantize stage on a Qwen2.5-7B-shaped checkpoint with the shipped defaults against the classic search
# (AutoAWQ's symmetric clip, no scale refit) and against GPTQ rounding, one process each, eval off, one device call.
#   OUT=/some/dir bash bench/gpu_awq_defaults.sh     (on the GPU host, from the repository root)
# $OUT/awq-defaults.json: per variant, the manifest's stage timings and pass seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-awq-defaults}
WORK=${WORK:-/tmp/gpu-awq-defaults-work}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK/r"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 QUANTIZE_CACHE_DIR="$WORK/cache"
exec > >(tee -a "$OUT/log.txt") 2>&1
$PY bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --out "$WORK/ckpt-7b"
declare -A AWQ=([default]="" [classic]="awq: {clip_search: symmetric, refit_iters: 0}" [gptq-rounding]="awq: {rounding: gptq}")
for v in classic default gptq-rounding; do
    printf 'name: awq-%s\nbase: %s\nmodel: %s\n%s\n' "$v" "$(pwd)/recipes/qwen7b-awq-g128.yaml" "$WORK/ckpt-7b" \
        "${AWQ[$v]}" > "$WORK/r/awq-$v.yaml"
    $PY -m pipeline run "$WORK/r/awq-$v.yaml" --out "$WORK/art" --force --no-eval
done
$PY - "$WORK/art" "$OUT/awq-defaults.json" <<'PYEOF'
import json, sys
from pathlib import Path
art, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = {}
for v in ("classic", "default", "gptq-rounding"):
    m = art / f"awq-{v}" / "manifest.json"
    if m.is_file():
        d = json.loads(m.read_text())
        rows[v] = {"timings_s": d["timings_s"], "pass_seconds": d.get("pass_seconds"), "awq": d["recipe"]["awq"]}
out.write_text(json.dumps(rows, indent=2))
print(json.dumps({k: v["timings_s"] for k, v in rows.items()}, indent=1))
PYEOF
