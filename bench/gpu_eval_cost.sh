#!/usr/bin/env bash
# What the eval's distribution metrics (KL, top-1) and the per-linear output error cost: the headline AWQ and GPTQ
# g128 runs with eval on, on a Qwen2.5-7B-shaped random-init checkpoint, from a tree without them (.gpu/old) and
# from this one, each with an empty reference cache; $OUT/summary.json gets each run's eval and quantize timings.
#
#   (here)  git archive 8ad878c | tar -x -C .gpu/old        # the tree before those metrics
#           pip download ... -d .gpu/whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#               typing-inspection==0.4.5 typing-extensions==4.16.0 compressed-tensors==0.17.0 loguru==0.7.3 gguf==0.19.0
#           (the GPU host's image lacks them; bench/peers/collect_wheels.sh says how to download for it)
#   (GPU)   RUNS="new:awq old:awq new:gptq old:gptq" bash bench/gpu_eval_cost.sh     (device tool: carry .gpu)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$(pwd); W=/tmp/w; mkdir -p $W/r "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
t0=$(date +%s.%N); python3 bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --device cuda --out $W/ckpt > $W/build.log 2>&1; echo "build rc=$? $(awk -v a=$t0 -v b=$(date +%s.%N) 'BEGIN{print b-a}') s"
run() {  # run TREE METHOD EXTRA
  local tree=$1 m=$2 extra=$3 name=h200-$1-$2
  printf 'name: %s\nbase: %s\nmodel: %s\n%s\n' $name "$ROOT/$( [ $tree = old ] && echo .gpu/old/ )recipes/qwen7b-$m-g128.yaml" $W/ckpt "$extra" > $W/r/$name.yaml
  local dir=$ROOT; [ $tree = old ] && dir=$ROOT/.gpu/old
  local s=$(date +%s.%N)
  (cd $dir && QUANTIZE_CACHE_DIR=$W/cache-$tree-$m timeout 280 python3 -m pipeline run $W/r/$name.yaml --out $W/art --force > $W/$name.log 2>&1)
  local rc=$?
  echo "=== $name rc=$rc wall $(awk -v a=$s -v b=$(date +%s.%N) 'BEGIN{printf "%.2f", b-a}') s"
  mkdir -p $W/keep/$name; cp $W/art/$name/report.json $W/art/$name/manifest.json $W/keep/$name/ 2>/dev/null
  tail -4 $W/$name.log
  rm -rf $W/art/$name
}
NOGATE="eval: {max_kl: null, min_top1: null}"
for job in ${RUNS:-new:awq old:awq new:gptq old:gptq}; do run ${job%%:*} ${job##*:} "$( [ ${job%%:*} = new ] && echo "$NOGATE")"; done
python3 - <<'PY'
import json, os, pathlib
out = {}
for d in sorted(pathlib.Path("/tmp/w/keep").iterdir()):
    rec = {}
    for f in ("report.json", "manifest.json"):
        p = d / f
        if p.is_file():
            rec[f] = json.loads(p.read_text())
    r, m = rec.get("report.json", {}), rec.get("manifest.json", {})
    out[d.name] = {"eval_timings_s": r.get("eval_timings_s"), "quantize_timings_s": m.get("timings_s"),
                   "perplexity": r.get("perplexity"), "distribution": r.get("distribution"),
                   "scored_on": r.get("scored_on"), "passed": r.get("passed"), "output_error_layers": len(m.get("output_error") or {}),
                   "report": r}
pathlib.Path(os.environ["OUT"], "summary.json").write_text(json.dumps(out, indent=1))
for k, v in out.items():
    print(k, "eval", v["eval_timings_s"], "quantize", v["quantize_timings_s"])
PY
