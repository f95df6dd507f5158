"""The stages the pipeline chains over one artifact after it is quantized: evaluate it, then write the report,
the model card with the measured numbers and the manifest's record of both into the artifact."""

from __future__ import annotations

import json
from pathlib import Path

from quantize import manifest
from quantize.export import modelcard
from quantize.files import atomic_write_text
from quantize.preflight.checks import PreflightError
from quantize.records import Report
from quantize.source import ModelSource

from eval import refcache, report as eval_report
from eval.report_md import render_markdown
from eval.artifact import quantization_format
from eval.perplexity import Protocol, load_eval_text, windows


def evaluate(artifact: Path, base: str | None, eopts, cache: dict | None = None,
             hashes: BaseHashes | None = None) -> Report:
    """The eval stage on `artifact` (see `eval.report.evaluate`), its report written into the artifact -> report. A
    directory whose layout the eval cannot decode is refused first, before minutes of scoring the reference."""
    quantization_format(artifact)
    report = eval_report.evaluate(artifact, base, eopts, cache=cache, base_hashes=hashes.started if hashes else (),
                                  resolved=tuple(hashes.sources.values()) if hashes else ())
    write_report(Path(artifact), report)
    return report


def check_eval_inputs(recipes, tokenizer, *_) -> None:
    """Before any weight loads (`preflight.stage.preflight`'s before_weights, whose model and device it does not
    need): the eval text of each recipe that evaluates exists and holds at least one perplexity window, so a run
    is not refused only after its quantize stage."""
    for r in recipes:
        if not r.eval.enabled:
            continue
        p = r.eval.perplexity
        text, _ = load_eval_text(p.dataset)
        if _head_holds_a_window(tokenizer, text, p.seq_len):
            continue
        try:
            windows(tokenizer, text, Protocol(dataset=p.dataset, seq_len=p.seq_len, max_windows=1))
        except ValueError as e:
            raise PreflightError(f"{r.name}: {e} (checked before quantizing, as the eval stage would fail)") \
                from None


class BaseHashes:
    """The base models' files hashed while a run or comparison that evaluates on a GPU quantizes: its eval needs
    their sha256 (the reference cache's key) and would otherwise hash a 7B checkpoint's 15 GB after the artifact is
    written, with the GPU idle. `before_weights` is the runner's pre-flight hook: the eval inputs' check, then, on a
    CUDA run, one `refcache.HashAhead` per base model. `cancel` stops every hash still running (call it on every
    way out: the interpreter's exit waits for their threads).
    sources: each base model as pre-flight resolved it, by its spec: the eval reads the same directory rather than
    resolving it again (for a GGUF, hashing the file once more)."""

    def __init__(self):
        self.started: list[refcache.HashAhead] = []
        self.sources: dict[str, ModelSource] = {}

    def before_weights(self, recipes, tokenizer, src: ModelSource, device) -> None:
        check_eval_inputs(recipes, tokenizer)
        self.sources[src.spec] = src
        if not any(r.eval.enabled for r in recipes) or device.type != "cuda":
            return  # on the CPU the quantize stage is itself the processor's work: nothing to overlap
        path = src.path.resolve()
        if all(h.path != path for h in self.started):
            self.started.append(refcache.HashAhead(path))

    def cancel(self) -> None:
        for h in self.started:
            h.cancel()


def _head_holds_a_window(tokenizer, text: str, seq_len: int) -> bool:
    """Whether the text's first 16 x seq_len characters, cut at a space, already tokenize to well over one window
    (an eighth more, plus 8: a cut can only change the tokens of the piece it ends in). The whole WikiText-2 test
    text takes seconds to tokenize; its head, milliseconds. False: the caller tokenizes it all."""
    head = text[: 16 * seq_len]
    if len(head) < len(text):
        head = head[: max(head.rfind(" "), 0)]
    n = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    return n >= seq_len + seq_len // 8 + 8


def write_report(artifact: Path, report: Report) -> None:
    """report.json + report.md into the artifact; for our artifacts the model card gains the numbers, and the
    manifest records the report's hashes and the new card (each write atomic)."""
    atomic_write_text(artifact / "report.json", json.dumps(report.written().to_json(), indent=2) + "\n")
    atomic_write_text(artifact / "report.md", render_markdown(report))
    m = manifest.read(artifact)
    manifest.add_report(artifact, report.passed, modelcard.render(m, report) if m is not None else None)
