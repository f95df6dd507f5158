"""The 4-bit kernel probe (`eval.serve.int4_kernel_missing`) asks a child process that imports vLLM's kernels
(~5 s); its answer is kept on disk under what decides it, so a later process reads it instead."""

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from eval import serve


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """The uncached-per-process function on a CPU build, a fixed key, and a fake child -> (call, calls, answers)."""
    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(serve, "cuda_build", lambda: False)
    monkeypatch.setattr(serve, "_probe_key", lambda: "k")
    calls, answers = [], []

    def run(cmd, **kwargs):
        calls.append(cmd)
        rc, out = answers.pop(0)
        return subprocess.CompletedProcess(cmd, rc, stdout=out, stderr="")
    monkeypatch.setattr(serve.subprocess, "run", run)
    return serve.int4_kernel_missing.__wrapped__, calls, answers


def test_answer_kept_and_read_by_a_later_call(probe, tmp_path):
    call, calls, answers = probe
    answers += [(0, "False\n"), (0, "True\n")]
    assert call() == serve.INT4_MISSING and len(calls) == 1
    assert call() == serve.INT4_MISSING and len(calls) == 1  # read from the cache, no child
    entry = tmp_path / "vllm-int4" / "k.json"
    assert json.loads(entry.read_text()) == {"int4_kernel": False}
    entry.write_text("{damaged")
    answers[:] = [(0, "True\n")]
    assert call() is None and len(calls) == 2  # a damaged entry is asked again and rewritten
    assert json.loads(entry.read_text()) == {"int4_kernel": True}
    assert call() is None and len(calls) == 2
    entry.write_text('{"int4_kernel": "yes"}')  # not an answer this code wrote: asked again
    answers[:] = [(0, "False\n")]
    assert call() == serve.INT4_MISSING and len(calls) == 3


def test_a_failed_probe_is_not_remembered(probe, tmp_path):
    call, calls, answers = probe
    answers += [(1, ""), (0, "True\n")]
    assert call() == serve.INT4_MISSING and not (tmp_path / "vllm-int4" / "k.json").exists()
    assert call() is None and len(calls) == 2


def test_an_unwritable_cache_still_answers(probe, tmp_path, monkeypatch):
    call, calls, answers = probe
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory goes")
    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(blocked))
    answers += [(0, "True\n")]
    assert call() is None and len(calls) == 1


@pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed: the probe has no key")
def test_key_follows_the_interpreter_and_the_processor(monkeypatch):
    key = serve._probe_key()
    assert len(key) == 32 and serve._probe_key() == key
    monkeypatch.setattr(sys, "executable", sys.executable + "-other")
    assert serve._probe_key() != key
    monkeypatch.undo()
    real = serve.Path.read_text
    monkeypatch.setattr(serve.Path, "read_text", lambda self, *a, **k: "flags\t: fpu avx2" if str(self) == "/proc/cpuinfo"
                        else real(self, *a, **k))
    assert serve._probe_key() != key
