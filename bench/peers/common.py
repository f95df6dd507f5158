"""What the peer scripts (llmc_bench.py, llmc_gptq.py) share: our pipeline's exact calibration token blocks,
as the pre-tokenized dataset llm-compressor's `oneshot` takes, and the modifier fields their records leave out."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from quantize import calib

LIFECYCLE_FLAGS = {"initialized_", "finalized_", "started_", "ended_"}  # a modifier's run state, not its settings


def calibration(model: str, dataset: str, n_samples: int, seq_len: int, seed: int):
    """The blocks quantize.calib builds for this model's tokenizer (same text, seed and sampling) ->
    (tokenizer, text, samples [n_samples, seq_len], Dataset of input_ids and attention_mask, unshuffled)."""
    tok = AutoTokenizer.from_pretrained(model)
    text = calib.load_text(dataset)
    samples = calib.make_samples(text.documents, tok, n_samples, seq_len, seed)
    ds = Dataset.from_dict({"input_ids": samples.tolist(), "attention_mask": torch.ones_like(samples).tolist()})
    return tok, text, samples, ds
