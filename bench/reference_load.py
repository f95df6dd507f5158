"""The eval's reference load onto a GPU: transformers' own path (each tensor converted to the eval's dtype on the
host, then copied) against `source.load_model` (copied as stored, converted on the device), alternating, each
timed with the device synchronised; then every parameter and buffer of the two compared bit for bit.

    python bench/reference_load.py --model CKPT_DIR [--dtype float16] [--rounds 2] [--json OUT.json]

On a bf16 checkpoint loaded as float16 (the eval of a float16 recipe) the two differ in where the conversion runs;
in the checkpoint's own dtype they do the same work.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from quantize.source import load as source  # noqa: E402
from quantize.source.arch import attn_implementation  # noqa: E402


def plain(path: Path, dtype: torch.dtype):
    """transformers' from_pretrained as `source.load_model` calls it, without the on-device conversion."""
    config = source.read_config(source.resolve(str(path)))
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, device_map="cuda",
                                                attn_implementation=attn_implementation(config),
                                                use_safetensors=True).eval()


def on_device(path: Path, dtype: torch.dtype):
    return source.load_model(source.resolve(str(path)), dtype, device="cuda")


def timed(fn, *a):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = fn(*a)
    torch.cuda.synchronize()
    return model, round(time.perf_counter() - t0, 3)


def tensors(model) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": p.detach() for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device: this bench times loads onto a GPU; run it on a GPU host", file=sys.stderr)
        return 2
    if not (args.model / "config.json").is_file():
        print(f"error: --model {args.model}: no config.json there; pass a checkpoint directory", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    seconds: dict[str, list[float]] = {"plain": [], "on_device": []}
    for _ in range(args.rounds):
        for label, fn in (("plain", plain), ("on_device", on_device)):
            model, s = timed(fn, args.model, dtype)
            seconds[label].append(s)
            print(f"{label}: {s:.3f} s", flush=True)
            del model
            gc.collect()
            torch.cuda.empty_cache()
    a = {n: t.cpu() for n, t in tensors(plain(args.model, dtype)).items()}
    gc.collect()
    torch.cuda.empty_cache()
    b = tensors(on_device(args.model, dtype))
    differ = sorted(n for n in a if n not in b or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n].cpu()))
    differ += sorted(n for n in b if n not in a)
    rec = {"date": datetime.now(timezone.utc).date().isoformat(), "gpu": torch.cuda.get_device_name(),
           "host": platform.node(), "model": str(args.model), "dtype": args.dtype, "seconds": seconds,
           "tensors": len(a), "differ": differ[:20], "n_differ": len(differ),
           "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in b.values()})}
    print(json.dumps({k: rec[k] for k in ("seconds", "tensors", "n_differ", "dtypes")}))
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
