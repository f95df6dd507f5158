"""Perplexity under one fixed, recorded protocol.

Default protocol (the GPTQ/AWQ papers'): the text's rows joined with "\n\n" (the bundled WikiText-2 file
is already joined so), tokenized once without special tokens, cut into non-overlapping `seq_len`-token
windows, tail dropped, no extra BOS; perplexity = exp(mean token NLL) over every predicted token.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quantize.source.load import hub_offline
from quantize.errors import UserError
from quantize.progress import Progress

from . import distribution

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUNDLED = {"wikitext2": DATA_DIR / "wikitext2-raw-test.txt"}


@dataclass(frozen=True)
class Protocol:
    dataset: str = "wikitext2"
    seq_len: int = 2048
    max_windows: int | None = None  # None = every full window
    join: str = "\n\n"
    add_bos: bool = False
    stride: str = "non-overlapping"
    tail: str = "dropped"


C4_SHARD = "en/c4-validation.00000-of-00008.json.gz"  # the shard the GPTQ paper's C4 evaluation reads
C4_DOCS = 1100


class EvalInputError(UserError, ValueError):
    """An eval input (text, window length, base model) that cannot be scored; the message names the recipe key."""


def load_eval_text(dataset: str) -> tuple[str, str]:
    """'wikitext2', 'c4' (hub only: first 1100 documents of the first English validation shard, joined with
    "\n\n") or a local .txt path -> (text, source)."""
    if dataset == "c4":
        if hub_offline():
            raise EvalInputError("perplexity dataset 'c4' needs the Hugging Face hub (HF_HUB_OFFLINE=1 is set); "
                                 "use wikitext2 or a local .txt file")
        import datasets

        ds = datasets.load_dataset("allenai/c4", data_files={"validation": C4_SHARD}, split="validation")
        return "\n\n".join(ds.select(range(C4_DOCS))["text"]), f"hub:allenai/c4/{C4_SHARD}[:{C4_DOCS}]"
    path = BUNDLED.get(dataset, Path(dataset))
    if not path.is_file():
        raise EvalInputError(f"eval.perplexity.dataset {dataset!r}: no such file; use wikitext2, c4 (hub) or "
                             f"the path of a local .txt file")
    return path.read_text(encoding="utf-8"), str(path)


def windows(tokenizer, text: str, protocol: Protocol) -> torch.Tensor:
    """text -> token windows [n_windows, seq_len]."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    n = ids.numel() // protocol.seq_len
    if protocol.max_windows is not None:
        n = min(n, protocol.max_windows)
    if n == 0:
        raise EvalInputError(f"perplexity text {protocol.dataset!r} has {ids.numel()} tokens, fewer than one "
                             f"window of {protocol.seq_len}; lower eval.perplexity.seq_len or use a longer eval.perplexity.dataset")
    return ids[: n * protocol.seq_len].reshape(n, protocol.seq_len)  # [n, seq]


def batch_windows(device: torch.device, seq_len: int) -> int:
    """Windows per forward: one on the CPU (memory, and the recorded CPU numbers), about 16k tokens on a GPU
    (a 7B forward then fills the device; each window's NLL is the same whatever the batch)."""
    return 1 if device.type == "cpu" else max(1, BATCH_TOKENS // seq_len)


BATCH_TOKENS = 16384


@torch.no_grad()
def perplexity(model, wins: torch.Tensor, batch: int = 1, label: str = "model", keep_topk: int | None = None,
               reference: dict | None = None) -> dict:
    """Token-level exp(mean NLL) over windows [n, seq], `batch` windows per forward
    -> {ppl, nll_sum, tokens, per_window_nll, seconds}, plus from the same forwards:
    keep_topk=k: "topk" = {"k", "logp" [n, seq - 1, k] float32, "idx" int32}, the model's k most likely next
    tokens (a reference's distributions, for `distribution.compare`);
    reference=that record: "distribution" = `distribution.summary` of this model against it (KL, top-1)."""
    device = next(model.parameters()).device
    nll_sum, tokens, per_window = 0.0, 0, []
    kept, compared = [], []
    t0 = time.perf_counter()
    progress = Progress(len(wins), f"perplexity {label}", log, "window")
    for start in range(0, len(wins), batch):
        ids = wins[start : start + batch].to(device)  # [b, seq]
        logits = model(input_ids=ids, use_cache=False).logits  # [b, seq, vocab]
        for j in range(ids.shape[0]):
            # float32 log-probs straight from the 16-bit logits (on CUDA one kernel reads float16 and writes float32;
            # no float32 copy of the logits first)
            logp = F.log_softmax(logits[j, :-1], -1, dtype=torch.float32)  # [seq - 1, vocab]
            nll = F.nll_loss(logp, ids[j, 1:], reduction="sum").item()  # = cross_entropy, one log_softmax shared
            if keep_topk:
                kept.append(distribution.reference_topk(logp, keep_topk))
            if reference is not None:
                w = start + j
                compared.append(distribution.compare(logp, reference["logp"][w], reference["idx"][w]))
            del logp
            nll_sum += nll
            tokens += ids.shape[1] - 1
            per_window.append(nll / (ids.shape[1] - 1))
            progress.step(f"perplexity {label}: window {len(per_window)}/{len(wins)}, running ppl "
                          f"{_exp(nll_sum / tokens):.4f}", f"ppl {_exp(nll_sum / tokens):.4f}")
        del logits
    progress.close()
    out = {"ppl": _exp(nll_sum / tokens), "nll_sum": nll_sum,
           "tokens": tokens, "per_window_nll": per_window, "seconds": round(time.perf_counter() - t0, 2)}
    if keep_topk:
        out["topk"] = {"k": keep_topk, "logp": torch.stack([v for v, _ in kept]),  # [n, seq - 1, k]
                       "idx": torch.stack([i for _, i in kept])}
    if reference is not None:
        out["distribution"] = distribution.summary(compared, reference["k"])
    return out


def _exp(mean_nll: float) -> float:
    """exp of a mean NLL; NaN stays NaN (a NaN model must fail the gates), overflow is inf."""
    return math.exp(mean_nll) if mean_nll < 700 or math.isnan(mean_nll) else math.inf


def protocol_record(protocol: Protocol, text: str, source: str, wins: torch.Tensor) -> dict:
    return {**asdict(protocol), "source": source, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "windows": int(wins.shape[0]), "tokens_scored": int(wins.shape[0] * (wins.shape[1] - 1))}
