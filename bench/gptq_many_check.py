"""GPU check: `gptq.gptq_quantize_many` (widest factorisation on a side stream) gives exactly what separate
`gptq_quantize` calls give, at one Qwen2.5-7B layer's shapes, and how long each takes.

    python3 bench/gptq_many_check.py          (on the GPU host; prints one JSON line)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantize import gptq  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def problems(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for out_f, in_f in SHAPES.values():
        x = (torch.randn(8192, in_f, device="cuda", generator=g) * torch.exp(torch.randn(in_f, device="cuda",
                                                                                          generator=g))).bfloat16()
        out.append(((torch.randn(out_f, in_f, device="cuda", generator=g) * 0.02).bfloat16(),
                    torch.mm(x.t(), x, out_dtype=torch.float32) * (2.0 / x.shape[0])))
    return out


def main() -> None:
    spec = gptq.GptqSpec(4, 128, True, 128, 0.01, act_order=True, scale_dtype=torch.bfloat16)
    probs = problems(0)
    gptq.gptq_quantize_many(probs, spec)  # warm-up (Triton compile, cuSOLVER handles)
    torch.cuda.synchronize()
    t = time.perf_counter()
    one = [gptq.gptq_quantize(W, H, spec) for W, H in probs]
    torch.cuda.synchronize()
    t_one = time.perf_counter() - t
    t = time.perf_counter()
    many = gptq.gptq_quantize_many(probs, spec)
    torch.cuda.synchronize()
    t_many = time.perf_counter() - t
    same = {name: bool(torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
                       and torch.equal(a.zeros, b.zeros)) for name, a, b in zip(SHAPES, one, many)}
    print(json.dumps({"identical": same, "separate_s": round(t_one, 4), "many_s": round(t_many, 4)}), flush=True)


if __name__ == "__main__":
    main()
