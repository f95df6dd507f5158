"""What the peer scripts (llmc_bench.py, llmc_gptq.py, llmc_awq.py, autoawq_quant.py) share: their common
command-line flags, our pipeline's exact calibration token blocks (as the pre-tokenized dataset llm-compressor's
`oneshot` takes) with the record of them, and the modifier fields their records leave out."""

from __future__ import annotations

import argparse
import json
import resource
import time
from importlib.metadata import version
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from quantize import calib

LIFECYCLE_FLAGS = {"initialized_", "finalized_", "started_", "ended_"}  # a modifier's run state, not its settings
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every peer script takes: model, output, group size, our calibration blocks' settings, dtype."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True, help="local HF safetensors directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--n-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", default="groups-merged")
    ap.add_argument("--compute-dtype", choices=DTYPES, default="float32")
    return ap


def calibration_record(args, text, samples: torch.Tensor) -> dict:
    """What a peer's record says of its calibration: the same text, seed and blocks as ours (their sha256)."""
    return {"dataset": args.dataset, "source": text.source, "text_sha256": text.sha256,
            "n_samples": args.n_samples, "seq_len": args.seq_len, "seed": args.seed,
            "blocks_sha256": calib.samples_sha256(samples)}


def calibration(model: str, dataset: str, n_samples: int, seq_len: int, seed: int):
    """The blocks quantize.calib builds for this model's tokenizer (same text, seed and sampling) ->
    (tokenizer, text, samples [n_samples, seq_len], Dataset of input_ids and attention_mask, unshuffled)."""
    tok = AutoTokenizer.from_pretrained(model)
    text = calib.load_text(dataset)
    samples = calib.make_samples(text.documents, tok, n_samples, seq_len, seed)
    ds = Dataset.from_dict({"input_ids": samples.tolist(), "attention_mask": torch.ones_like(samples).tolist()})
    return tok, text, samples, ds


def oneshot_and_save(model, tok, ds, recipe, args, out) -> float:
    """llm-compressor's `oneshot` on our blocks (in order, batch 1), then the model saved compressed in
    --save-dtype beside the tokenizer -> oneshot's seconds."""
    import time

    from llmcompressor import oneshot

    t1 = time.perf_counter()
    oneshot(model=model, processor=tok, dataset=ds, recipe=recipe, num_calibration_samples=args.n_samples,
            max_seq_length=args.seq_len, shuffle_calibration_samples=False, batch_size=1)
    seconds = time.perf_counter() - t1
    model.to(DTYPES[args.save_dtype])
    model.config.dtype = DTYPES[args.save_dtype]
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    return seconds


def llmc_record(peer: str, args, out: Path, text, samples: torch.Tensor, t0: float, oneshot_s: float,
                **modifiers) -> dict:
    """The run record llm-compressor's peer scripts write to OUT/peer_run.json: versions, model, calibration,
    the modifiers' settings (keyword -> modifier, or -> a list of them), the saved quantization_config, timings
    (oneshot, and the whole process since t0) and peak RSS."""
    def dump(m):
        return m.model_dump(mode="json", exclude_none=True, exclude=LIFECYCLE_FLAGS)

    return {
        "peer": peer,
        "versions": {p: version(p) for p in ("llmcompressor", "transformers", "torch", "compressed-tensors")},
        "model": str(Path(args.model).resolve()),
        "calibration": calibration_record(args, text, samples),
        **{k: [{type(x).__name__: dump(x)} for x in v] if isinstance(v, list) else dump(v)
           for k, v in modifiers.items()},
        "quantization_config": json.loads((out / "config.json").read_text())["quantization_config"],
        "compute_dtype": args.compute_dtype, "save_dtype": args.save_dtype,
        "oneshot_s": round(oneshot_s, 2), "total_s": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
