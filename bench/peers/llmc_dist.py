"""llm-compressor's distributed oneshot (torchrun, one process per GPU) on the same layers, for bench/gpu_dist.py.

    torchrun --standalone --nproc-per-node 2 bench/peers/llmc_dist.py --method gptq --model DIR --out DIR --json R.json

Follows llm-compressor's "Distributed Oneshot" guide: `compressed_tensors.offload.init_dist()`, the model loaded
inside `load_offloaded_model()` with device_map "auto_offload", each rank calibrating on its disjoint share of
the calibration blocks (the ones our pipeline uses, bench/peers/common.calibration), the same recipes as
bench/peers/llmc_bench.py. When the installed compressed-tensors / llm-compressor lack those entry points, the
record says so (supported: false, the import error) and the script exits 0: an older version is a fact to
report, not a failed run. Rank 0 writes the record, with every rank's peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.versions import installed  # noqa: E402

PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch")

GIB = 2**30



def entry_points():
    """-> (init_dist, load_offloaded_model, oneshot), or the ImportError saying what this version lacks."""
    try:
        from compressed_tensors.offload import init_dist, load_offloaded_model
        from llmcompressor import oneshot
    except ImportError as e:
        return e
    return init_dist, load_offloaded_model, oneshot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("awq", "gptq"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--n-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=1)
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    found = entry_points()
    if isinstance(found, ImportError):
        if rank == 0:
            record = {"runner": "llmcompressor-dist", "method": args.method, "supported": False,
                      "reason": f"this llm-compressor / compressed-tensors has no distributed oneshot: {found}",
                      "versions": installed(PACKAGES)}
            args.json.write_text(json.dumps(record, indent=2) + "\n")
            print(json.dumps(record), flush=True)
        return
    init_dist, load_offloaded_model, oneshot = found
    init_dist()
    from transformers import AutoModelForCausalLM

    from bench.peers.common import calibration
    from bench.peers.llmc_bench import modifiers, skip_pinning_without_accelerator

    tok, text, samples, ds = calibration(args.model, "groups-merged", args.n_samples, args.seq_len, args.seed)
    share = range(len(ds) * rank // world, len(ds) * (rank + 1) // world)
    ds = ds.select(share)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    with load_offloaded_model():
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="auto_offload")
    load_s = time.perf_counter() - t
    recipe = modifiers(args.method)
    skip_pinning_without_accelerator()
    t = time.perf_counter()
    oneshot(model=model, processor=tok, dataset=ds, recipe=recipe, num_calibration_samples=len(share),
            max_seq_length=args.seq_len, shuffle_calibration_samples=False, batch_size=args.batch_size)
    if cuda:
        torch.cuda.synchronize()
    oneshot_s = time.perf_counter() - t
    mine = {"rank": rank, "peak_gpu_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else None,
            "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else None,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "oneshot_s": round(oneshot_s, 3)}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        n_layers = model.config.num_hidden_layers
        oneshot_max = max(r["oneshot_s"] for r in ranks)
        record = {"runner": "llmcompressor-dist", "method": args.method, "supported": True, "world_size": world,
                  "versions": installed(PACKAGES), "layers": n_layers,
                  "stages_s": {"load": round(load_s, 3), "oneshot": round(oneshot_max, 3)},
                  "oneshot_per_layer_s": round(oneshot_max / n_layers, 3),
                  "peak_gpu_alloc_gib": max((r["peak_gpu_alloc_gib"] or 0) for r in ranks) if cuda else None,
                  "peak_gpu_reserved_gib": max((r["peak_gpu_reserved_gib"] or 0) for r in ranks) if cuda else None,
                  "process_s": round(time.perf_counter() - T0, 2), "ranks": ranks}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
