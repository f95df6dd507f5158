#!/usr/bin/env bash
# Issue 5: a group-size sweep in one shared pass against the same variants run one by one (CPU, SmolLM2).
#
#   bash bench/sweep_vs_separate.sh            # writes bench/results/sweep-vs-separate-<date>.json
#
# 1. `python -m quantize compare smollm2-awq-sweep` (g32 + g64: one load, one calibration, one layer pass,
#    then each variant's eval; its comparison files land in artifacts/), 2. the same two variants as separate
#    `python -m quantize run` (eval off), then checks that each pair of weight files is byte-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export HF_HUB_OFFLINE=1
SEP=.cache/sweep-bench/separate
mkdir -p "$SEP" bench/results
now() { date +%s.%N; }
t0=$(now); $PY -m quantize compare smollm2-awq-sweep --force; t1=$(now)
for g in 32 64; do
    s=$(now); $PY -m quantize run smollm2-awq-g$g --out "$SEP" --force --no-eval; e=$(now)
    echo "$g $(echo "$e - $s" | bc)" >> "$SEP/times.txt"
done
$PY - "$t0" "$t1" <<'PY'
import hashlib, json, platform, os, sys, datetime
from pathlib import Path
t0, t1 = map(float, sys.argv[1:3])
sep = Path(".cache/sweep-bench/separate")
lines = (sep / "times.txt").read_text().split("\n")[-3:-1]
separate = {f"g{l.split()[0]}": float(l.split()[1]) for l in lines}
doc = json.loads(Path("artifacts/compare-smollm2-awq-sweep.json").read_text())
def h(p): return hashlib.sha256(p.read_bytes()).hexdigest()
same = {g: h(Path(f"artifacts/smollm2-awq-sweep-{g}/model.safetensors")) == h(sep / f"smollm2-awq-{g}/model.safetensors")
        for g in ("g32", "g64")}
sep_quant = {g: json.loads((sep / f"smollm2-awq-{g}/manifest.json").read_text())["timings_s"] for g in ("g32", "g64")}
shared = json.loads(Path("artifacts/smollm2-awq-sweep-g32/manifest.json").read_text())
out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores, no GPU",
       "compare_wall_s_incl_eval": round(t1 - t0, 1), "compare_timings_s": doc["timings_s"],
       "shared_pass": shared["shared_pass"], "shared_stages_s": {k: v for k, v in shared["timings_s"].items()},
       "separate_wall_s": separate, "separate_timings_s": sep_quant,
       "weights_byte_identical": same, "rows": [{k: r[k] for k in ("variant", "ppl", "delta_ppl_pct", "bits_per_weight", "bytes_on_disk", "vllm_smoke")} for r in doc["rows"]]}
p = Path(f"bench/results/sweep-vs-separate-{out['date']}.json")
p.write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps(out, indent=2))
PY
