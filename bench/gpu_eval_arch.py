"""On a GPU host: `python -m pipeline run` (quantize + eval on cuda) for tiny random models, AWQ and GPTQ, then
`python -m pipeline compare` of two group sizes on the last one, eval on. A functional check of the stages on the
device (tiny untrained models: their perplexities say nothing about quality). JSON in $OUT/gpu_eval_arch.json.

    python3 bench/gpu_eval_arch.py [KIND ...]      # default: the MoE kinds
    python3 bench/gpu_eval_arch.py --no-compare gemma2 phi3 olmo2
    python3 bench/gpu_eval_arch.py --device cpu --no-compare granite    # the same record off a GPU host

KIND: a tiny kind of tests/conftest.py (TINY) or a dense model of tests/integration/test_architectures.py (MODELS),
each built by that file's own builder, in the dtype its tests use.
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from transformers import AutoConfig
from quantize.source.arch import arch_for
from tests.conftest import TINY, build_tiny_model, tiny_recipe
from tests.integration.test_architectures import MODELS, build
out = Path(os.environ.get("OUT", "/tmp/o")); work = Path("/tmp/gea"); work.mkdir(exist_ok=True)
rows = []
env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "") + ":" + os.getcwd(), "HF_HUB_OFFLINE": "1"}
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("kinds", nargs="*", default=["qwen3_moe", "mixtral", "qwen2_moe"], metavar="KIND")
ap.add_argument("--no-compare", dest="compare", action="store_false", help="skip `pipeline compare`")
ap.add_argument("--device", default="cuda", help="the recipes' device (default cuda)")
args = ap.parse_args()
COMPARE, DEVICE, KINDS = args.compare, args.device, args.kinds
for kind in KINDS:
    if kind in MODELS:
        m, dt = build(work / kind, kind), MODELS[kind][4]
    elif kind in TINY:
        m = build_tiny_model(work / kind, kind, hidden=128, intermediate=256, layers=2)
        dt = "float16" if "float16" in arch_for(AutoConfig.from_pretrained(m)).serve_dtypes else "bfloat16"
    else:
        raise SystemExit(f"error: no tiny model {kind!r}; kinds: {sorted({*TINY, *MODELS})}")
    for method, over in (("awq", {}), ("gptq", dict(method="gptq", zero_point=False))):
        r = tiny_recipe(work, m, name=f"{kind}-{method}", device=DEVICE, dtype=dt,
                        eval=dict(perplexity=dict(dataset="wikitext2", seq_len=256, max_windows=8)), **over)
        t = time.time()
        p = subprocess.run([sys.executable, "-m", "pipeline", "run", str(r), "--out", str(work / "a")], env=env,
                           capture_output=True, text=True)
        art = work / "a" / r.stem
        rep = json.loads((art / "report.json").read_text()) if (art / "report.json").exists() else {}
        man = json.loads((art / "manifest.json").read_text()) if (art / "manifest.json").exists() else {}
        row = dict(model=kind, method=method, rc=p.returncode, wall_s=round(time.time() - t, 1),
                   stages_s=man.get("timings_s"), ppl=rep.get("perplexity"), quantize_device=man.get("device"),
                   eval_device=(rep.get("scored_on") or {}).get("device"), vllm_smoke=rep.get("vllm_smoke"),
                   err=p.stderr.strip().splitlines()[-1:] if p.returncode else None)
        rows.append(row); print(json.dumps(row)[:600], flush=True)
        (out / "gpu_eval_arch.json").write_text(json.dumps(rows, indent=1, default=str))
if not COMPARE:
    raise SystemExit(0)
# compare on the last model: two group sizes, one pass, eval on the GPU
m = work / KINDS[-1]
rs = [tiny_recipe(work, m, name=f"cmp-g{g}", device=DEVICE, q_group_size=g,
                  eval=dict(perplexity=dict(dataset="wikitext2", seq_len=256, max_windows=8))) for g in (32, 64)]
t = time.time()
p = subprocess.run([sys.executable, "-m", "pipeline", "compare", *map(str, rs), "--name", "moe", "--out", str(work / "c")],
                   env=env, capture_output=True, text=True)
print("compare rc", p.returncode, round(time.time() - t, 1), p.stdout[-1500:], p.stderr[-800:] if p.returncode else "")
rows.append(dict(compare_rc=p.returncode, wall_s=round(time.time() - t, 1), stdout_tail=p.stdout[-1500:]))
(out / "gpu_eval_arch.json").write_text(json.dumps(rows, indent=1, default=str))
