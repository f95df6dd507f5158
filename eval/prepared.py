"""The eval's inputs that do not depend on the artifact, prepared while the quantize stage runs.

`pipeline run` evaluates the artifact it has just written. Before the eval's first forward it needs the base
model's source and tokenizer, the sha256 of the model's files (the reference cache's key: 15 GB for a 7B model)
and the perplexity windows (tokenizing the whole WikiText-2 test text). None of that depends on the artifact, so a
run on a GPU starts it in a background thread once pre-flight has passed; the pass keeps the GPU busy and leaves
the host's cores mostly idle, and hashing and the tokenizer's encoding release the GIL. On the CPU the pass uses
every core, so there it would only take them from the pass: a CPU run does not start it.

`evaluate` takes the prepared inputs only for the base model and protocol they were made for; if preparing failed
or was for something else, the eval computes them itself, as it does without them (and raises its own error).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from quantize.source import load as source

from . import refcache
from .perplexity import Protocol, load_eval_text, windows

log = logging.getLogger(__name__)

HASH_WORKERS = 4  # beside the pass, which writes each layer's weights from host threads of its own


@dataclass(frozen=True)
class Inputs:
    src: source.ModelSource
    tokenizer: object
    model_sha256: str
    text: str
    where: str
    windows: object  # torch.Tensor [n, seq_len]
    seconds: float  # how long preparing them took, alongside the quantize stage


class Prepared:
    """Prepare the eval inputs of base model `base_spec` under perplexity options `popts` in a daemon thread.

    `take(base_spec, popts)` waits for them -> Inputs, or None when they were made for another base model or
    protocol, or preparing them failed. `stop()` ends the hashing early (a run that failed needs none of it)."""

    def __init__(self, base_spec: str, popts):
        self.base_spec = base_spec
        self.protocol = (popts.dataset, popts.seq_len, popts.max_windows)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._result: Inputs | None = None
        self._thread = threading.Thread(target=self._run, name="eval-inputs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            src = source.resolve(self.base_spec)
            tokenizer = source.load_tokenizer(src)
            dataset, seq_len, max_windows = self.protocol
            text, where = load_eval_text(dataset)
            wins = windows(tokenizer, text, Protocol(dataset=dataset, seq_len=seq_len, max_windows=max_windows))
            sha = refcache.model_sha256(src.path, workers=HASH_WORKERS, stop=self._stop)
            self._result = Inputs(src, tokenizer, sha, text, where, wins, round(time.perf_counter() - t0, 2))
        except refcache.HashStopped:
            pass
        except Exception as e:  # noqa: BLE001 - the eval computes them itself and reports its own error
            log.debug("eval inputs not prepared ahead (%s): the eval computes them", e)
        finally:
            self._done.set()

    def take(self, base_spec: str, popts) -> Inputs | None:
        if base_spec != self.base_spec or (popts.dataset, popts.seq_len, popts.max_windows) != self.protocol:
            return None
        self._done.wait()
        return self._result

    def stop(self) -> None:
        self._stop.set()
