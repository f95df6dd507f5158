#!/usr/bin/env bash
# Two trees of this repository on one GPU host, interleaved: `bench/bench_ours.py` (eval off, the bench recipes
# at g128) on one Qwen2.5-7B-shaped random-init checkpoint, each run a fresh process timed from interpreter start;
# then each method's last artifacts of the two trees compared tensor by tensor (bench/diff_artifacts.py).
#
#   OTHER=/path/to/other/tree OUT=/some/dir bash bench/gpu_tree_ab.sh      # on the GPU host, from this tree's root
#
# RUNS: the order, as tree:method words (tree: this, other, or nowarm: this tree with QUANTIZE_TRITON_WARMUP=off;
# method: gptq or awq; default below). OTHER is needed only where RUNS names it.
# COLD=1: each run starts with an empty Triton cache of its own (a fresh host's first run); the number of compiled
# kernels it left there and the run's "Triton warm-up" log line go into its record.
# $OUT gets ab.json (every run's bench record, the diffs) and ab.tar.gz (the runs' logs); the artifacts are
# removed once compared (a 7B checkpoint plus four artifacts fill most of the GPU host's disk).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OTHER=${OTHER:-}
COLD=${COLD:-0}
OUT=${OUT:-/tmp/gpu-tree-ab}
WORK=${WORK:-/tmp/gpu-tree-ab-work}
RUNS=${RUNS:-"this:gptq other:gptq this:gptq other:gptq this:awq other:awq this:awq"}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK/r" "$WORK/logs" "$WORK/json"
if [ -d .whl ]; then
    $PY -c "import sys; sys.path.insert(0, '.'); from pathlib import Path; from bench.gpu_bench import install_wheels; install_wheels(Path('.whl'), Path('$WORK/site'))"
    export PYTHONPATH="$WORK/site"
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 QUANTIZE_CACHE_DIR="$WORK/cache"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --out "$WORK/ckpt/qwen2.5-7b" --device cuda | tail -1
n=0
for item in $RUNS; do
    tree=${item%%:*}; method=${item#*:}; n=$((n + 1))
    warm=on
    case "$tree" in
        this) dir=$ROOT;;
        nowarm) dir=$ROOT; warm=off;;
        other) dir=${OTHER:?RUNS names the other tree: set OTHER};;
        *) echo "error: RUNS names tree '$tree'; use this, other or nowarm" >&2; exit 2;;
    esac
    tc=""
    if [ "$COLD" = 1 ]; then tc="$WORK/triton/$n"; rm -rf "$tc"; mkdir -p "$tc"; fi
    recipe="$WORK/r/bench-$method.yaml"
    printf 'name: bench-%s\nbase: %s\nmodel: %s\ndevice: cuda\ncalibration: {n_samples: 128, seq_len: 512}\n' \
        "$method" "$dir/bench/recipes/bench-$method-g128.yaml" "$WORK/ckpt/qwen2.5-7b" > "$recipe"
    # each run writes a new output, as a first run does: replacing the previous run's artifact would add its
    # removal (1.8-2.2 s for 5.6 GB on these hosts) to this run's export
    rm -rf "$WORK/art-$tree/bench-$method"
    t0=$(date +%s.%N)
    (cd "$dir" && export QUANTIZE_TRITON_WARMUP=$warm ${tc:+TRITON_CACHE_DIR=$tc} && $PY bench/bench_ours.py "$recipe" \
        --out-root "$WORK/art-$tree" --json "$WORK/json/$n-$tree-$method.json" > "$WORK/logs/$n-$tree-$method.log" 2>&1)
    rc=$?; t1=$(date +%s.%N)
    echo "run $n $tree $method: exit $rc $(grep -o '"process_s": [0-9.]*' "$WORK/json/$n-$tree-$method.json" 2>/dev/null)"
    $PY - "$WORK/json/$n-$tree-$method.json" "$WORK/logs/$n-$tree-$method.log" "$tc" "$t0" "$t1" <<'EOF'
import json, sys
from pathlib import Path
rec, logf, tc = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if rec.exists():
    r = json.loads(rec.read_text())
    # the shell's clock around the process: its start to its end, the interpreter's exit included (process_s is
    # taken inside the process, before the exit)
    r["shell_wall_s"] = round(float(sys.argv[5]) - float(sys.argv[4]), 2)
    r["triton_warmup_log"] = [l.strip() for l in logf.read_text().splitlines() if "Triton warm-up" in l]
    if tc:  # one directory per compiled kernel (its key's hash)
        r["triton_cache_entries"] = sum(1 for p in Path(tc).rglob("*") if p.is_dir() and p.parent == Path(tc))
    rec.write_text(json.dumps(r, indent=1))
    print("   ", r["triton_warmup_log"][-1:] or "(no warm-up line)", "cache entries:", r.get("triton_cache_entries"))
EOF
done
for method in gptq awq; do
    for tree in other nowarm; do
        if [ -d "$WORK/art-this/bench-$method" ] && [ -d "$WORK/art-$tree/bench-$method" ]; then
            $PY bench/diff_artifacts.py "$WORK/art-$tree/bench-$method" "$WORK/art-this/bench-$method" \
                --json "$WORK/json/diff-$tree-$method.json" > /dev/null \
                && echo "diff $tree $method: $(tr -d '\n ' < "$WORK/json/diff-$tree-$method.json" | head -c 600)"
        fi
    done
done
$PY - "$WORK/json" "$OUT/ab.json" <<'EOF'
import json, sys
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(src.glob("*.json"), key=lambda p: p.stem)}
for k, r in runs.items():
    if "stages_s" in r:
        print(k, "process", r["process_s"], "shell wall", r.get("shell_wall_s"), "stages", r["stages_s"],
              "preflight parts", r.get("preflight_parts_s"), "first layer", (r.get("per_layer") or {}).get("seconds", [None])[0],
              "export parts", r["runlog"].get("export_parts"))
out.write_text(json.dumps(runs, indent=1) + "\n")
EOF
tar -czf "$OUT/ab.tar.gz" -C "$WORK" logs
rm -rf "$WORK/art-this" "$WORK/art-other" "$WORK/art-nowarm" "$WORK/triton"
