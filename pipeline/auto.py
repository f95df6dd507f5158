"""`method: auto`: every candidate method quantized in one shared pass, each scored against the unquantized model on
calibration samples held out of the fit, and the artifact of the lowest KL written under the recipe's name.

The candidates are the recipe naming each method (`Recipe.candidate`): same name, same settings, so the winner's
directory is the one a run of the recipe with that method writes (weights byte for byte: a shared pass computes
what each recipe computes alone). They are written into `<out>/.<name>.auto/<method>/` by `runner.run_many`, one
model load, one calibration and one layer-by-layer pass; the winner is then renamed into place and the rest
removed. The held-out samples are the `auto.holdout_samples` blocks that follow the `calibration.n_samples` ones
in the same seeded token stream (`calib.make_samples` cuts a stream the longer request extends, so the blocks the
methods fit on are the recipe's own): calibration text, never the eval's. The winner's manifest records the
choice (`records.AutoChoice`), its card shows it, and `<out>/<name>.auto.json` holds the same record.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch

from eval import heldout
from eval.report import eval_dtype
from quantize import calib, manifest, runner
from quantize.calib import CalibrationError
from quantize.errors import UserError
from quantize.export import modelcard, write as export
from quantize.files import atomic_write_text, sha256_file
from quantize.paths import child
from quantize.preflight.stage import BeforeWeights
from quantize.recipe import Recipe
from quantize.records import AutoChoice, FileRecord

log = logging.getLogger(__name__)

STAGING = ".{name}.auto"  # under --out: the candidates' artifacts while they are scored
RECORD = "{name}.auto.json"  # under --out, beside the artifact: the choice (the manifest's `auto`)


def heldout_samples(recipe: Recipe, tokenizer) -> tuple[torch.Tensor, str]:
    """The recipe's calibration stream cut into n_samples + holdout_samples blocks -> (the held-out blocks
    [holdout_samples, seq_len], the sha256 of the first n_samples: the blocks the methods fit on, which the
    run's own calibration must equal). CalibrationError, saying what to lower, when the text is too short."""
    c, n = recipe.calibration, recipe.auto_options.holdout_samples
    text = calib.load_text(c.dataset, c.split, c.subset, c.text_column)
    try:
        blocks = calib.make_samples(text.documents, tokenizer, c.n_samples + n, c.seq_len, c.seed)  # [n + h, seq]
    except CalibrationError as e:
        raise CalibrationError(f"method auto holds {n} samples out of calibration, after the {c.n_samples} the "
                               f"methods fit on: {e}; or lower auto.holdout_samples") from None
    return blocks[c.n_samples:], calib.samples_sha256(blocks[: c.n_samples])


def run(recipe: Recipe, out_root: str | Path, force: bool = False, before_weights: BeforeWeights | None = None,
        out: Path | None = None, device: torch.device | None = None) -> Path:
    """Quantize every candidate of an auto recipe, score each on the held-out samples, write the winner's artifact
    to `out` (default <out_root>/<name>) -> its path. The caller holds `out`'s lock. before_weights: the caller's
    pre-flight hook (`runner.run`'s), called with the candidates."""
    t_start = time.perf_counter()
    out = Path(out) if out is not None else child(out_root, recipe.name, "recipe name")
    if out.exists() and not force:
        raise export.OutputExistsError(f"output {out} already exists; remove it or pass --force (make ... FORCE=1)")
    candidates, left_out = recipe.auto_candidates()
    for method, why in left_out.items():
        log.info("auto: %s is not a candidate here: %s", method, why)
    staging = child(out_root, STAGING.format(name=recipe.name), "recipe name")
    outs = [staging / c.method for c in candidates]
    held: dict = {}

    def hook(recipes, tokenizer, src, dev) -> None:  # before any weight loads: a too-short text fails here
        held["samples"], held["fit_sha256"] = heldout_samples(recipe, tokenizer)
        held["src"] = src
        if before_weights is not None:
            before_weights(recipes, tokenizer, src, dev)

    log.info("auto: %d candidates (%s) in one shared pass, then each scored on %d held-out calibration samples",
             len(candidates), ", ".join(c.method for c in candidates), recipe.auto_options.holdout_samples)
    try:
        # force: a staged directory is this recipe's own leftover (a run killed while scoring), never a user's
        written = runner.run_many(candidates, out_root, force=True, before_weights=hook, outs=outs, device=device)
        pass_s = round(time.perf_counter() - t_start, 3)
        choice = _choose(recipe, candidates, written, held, left_out, pass_s, device)
        choice.seconds = round(time.perf_counter() - t_start, 3)
        winner = written[[c.method for c in candidates].index(choice.chosen)]
        _record(winner, choice)
        export.remove_stale(out)
        old = export.swap_in(winner, out)
        if old is not None:
            export.remove_path(old)
    finally:
        for d in outs:  # the candidates that lost (the winner has moved); the pass's checkpoint stays for a resume
            shutil.rmtree(d, ignore_errors=True)
        if staging.is_dir() and not any(staging.iterdir()):
            staging.rmdir()
    atomic_write_text(Path(out_root) / RECORD.format(name=recipe.name), json.dumps(choice.to_json(), indent=2) + "\n")
    log.info("auto: chose %s (%s); %s", choice.chosen, choice.why, summary(choice))
    return out


def _choose(recipe: Recipe, candidates: list[Recipe], written: list[Path], held: dict, left_out: dict[str, str],
            pass_s: float, device: torch.device | None) -> AutoChoice:
    """Score every written candidate against the FP model on the held-out samples -> the choice (lowest KL)."""
    records = [manifest.read(w) for w in written]
    for m in records:  # the held-out blocks follow exactly the ones the run fitted on
        if m.calibration is not None and m.calibration.model_extra.get("samples_sha256") != held["fit_sha256"]:
            raise RuntimeError("auto: the run's calibration samples are not the blocks the held-out ones follow")
    device = torch.device(records[0].device) if device is None else device
    dtype = eval_dtype(device, recipe.dtype)
    samples = held["samples"]
    ref, reference_s = heldout.reference(held["src"], samples, dtype, device, recipe.trust_remote_code)
    rows = []
    for i, (c, w, m) in enumerate(zip(candidates, written, records), 1):
        log.info("auto: scoring candidate %d/%d, %s, on %d held-out samples", i, len(candidates), c.method,
                 samples.shape[0])
        s = heldout.score(w, samples, ref, dtype, device, f"held-out {c.method} ({i}/{len(candidates)})")
        rows.append({"method": c.method, "format": m.format.name, "kl_mean": s["kl_mean"], "top1": s["top1"],
                     "quantize_s": (m.timings_s or {}).get("quantize", 0.0), "score_s": s["seconds"],
                     **({"problem": s["problem"]} if s["problem"] else {})})
    chosen, why = pick(rows)
    c0 = recipe.calibration
    return AutoChoice.model_validate({
        "chosen": chosen, "why": why, "candidates": rows, "left_out": left_out,
        "holdout": {"first_sample": c0.n_samples, "n_samples": int(samples.shape[0]), "seq_len": c0.seq_len,
                    "tokens": int(samples.numel()), "samples_sha256": calib.samples_sha256(samples),
                    "top_k": ref["k"]},
        "pass_s": pass_s, "reference_s": reference_s, "seconds": 0.0}).written()


def pick(rows: list[dict]) -> tuple[str, str]:
    """Candidates' rows (in the recipe's order) -> (the method of the lowest held-out KL, why). Equal KLs: the
    first listed, and the reason says so. AutoError when none has a finite KL."""
    scored = [r for r in rows if r["kl_mean"] is not None]
    if not scored:
        raise AutoError("method auto: no candidate has a finite held-out KL (" +
                        "; ".join(f"{r['method']}: {r.get('problem')}" for r in rows) +
                        "); name a method, or try compute_dtype: float32")
    best = min(r["kl_mean"] for r in scored)
    tied = [r["method"] for r in scored if r["kl_mean"] == best]
    why = "lowest held-out KL" if len(tied) == 1 else \
        f"held-out KL tied between {', '.join(tied)}: the first listed in auto.candidates"
    invalid = [r["method"] for r in rows if r["kl_mean"] is None]
    if invalid:
        why += f"; not ranked: {', '.join(invalid)} (no finite KL)"
    return tied[0], why


class AutoError(UserError):
    """No candidate of `method: auto` can be chosen; the message names each one's problem."""


def _record(artifact: Path, choice: AutoChoice) -> None:
    """The choice into the winner's manifest (and the cost of choosing into its timings), its card re-rendered.
    Its files but the card are untouched: the artifact is the one the recipe naming that method writes."""
    m = manifest.read(artifact)
    m.auto = choice
    # the quantize stage that made it is the whole pass, every candidate's share (a pass of one recipe, the
    # winner alone, records its own as it is); the pass's other facts are the choice's (`auto`), as a run of one
    # method records no shared pass
    pass_stage = (m.shared_pass or {}).get("pass_s", (m.timings_s or {}).get("quantize"))
    m.shared_pass = None
    m.timings_s = {**(m.timings_s or {}), "quantize": pass_stage, "auto_score": round(
        choice.reference_s + sum(c.score_s for c in choice.candidates), 3)}
    card = artifact / manifest.CARD
    atomic_write_text(card, modelcard.render(m))
    m.files[manifest.CARD] = FileRecord(sha256=sha256_file(card), bytes=card.stat().st_size)
    atomic_write_text(artifact / manifest.MANIFEST, json.dumps(m.written().to_json(), indent=2) + "\n")


def summary(choice: AutoChoice) -> str:
    """One line: each candidate's held-out KL and seconds."""
    return ", ".join(f"{c.method} KL {modelcard.score_text(c.kl_mean)} in {c.quantize_s + c.score_s:.1f} s"
                     for c in choice.candidates)
