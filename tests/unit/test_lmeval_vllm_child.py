"""How `eval.lmeval.run_vllm` reads its child's end: scores written, then an abort at exit, keep the scores."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from eval import child, lmeval

RESULTS = {"results": {"wikitext_continuation": {"acc,none": 0.25, "acc_norm,none": 0.5, "alias": "w"}}}


def _child(rc: int, write: str | None):
    """A stand-in for the lm-eval child: writes `write` as its results file under --output_path, exits rc."""
    def run(cmd, *args, **kw):
        out = Path(cmd[cmd.index("--output_path") + 1]) / "art"
        out.mkdir()
        if write is not None:
            (out / "results_2026.json").write_text(write)
        return subprocess.CompletedProcess(cmd, rc, stdout="Saving results aggregated\n",
                                           stderr="terminate called without an active exception\n")
    return run


@pytest.mark.parametrize("rc", [0, -signal.SIGABRT])
def test_scores_written_stand_even_if_the_child_aborts_at_exit(monkeypatch, tmp_path, rc):
    monkeypatch.setattr(child, "run", _child(rc, json.dumps(RESULTS)))
    r = lmeval.run_vllm(tmp_path, ["wikitext_continuation"], 8, "float16", 60)
    assert r["scores"] == {"wikitext_continuation": {"acc": 0.25, "acc_norm": 0.5}}
    assert ("exit" in r) == (rc != 0) and "error" not in r
    if rc:
        assert "aborted after writing its results" in r["exit"] and "terminate called" in r["exit"]


@pytest.mark.parametrize("rc,write", [(-signal.SIGABRT, None), (-signal.SIGABRT, '{"results": {'),
                                      (1, json.dumps(RESULTS)), (-signal.SIGSEGV, json.dumps(RESULTS))])
def test_no_whole_results_or_another_failure_is_an_error(monkeypatch, tmp_path, rc, write):
    monkeypatch.setattr(child, "run", _child(rc, write))
    r = lmeval.run_vllm(tmp_path, ["wikitext_continuation"], 8, "float16", 60)
    assert "scores" not in r and r["error"] and r["exit_code"] == rc


def test_the_recipes_subset_reaches_the_child(monkeypatch, tmp_path):
    seen = []

    def run(cmd, *args, **kw):
        seen.append(cmd)
        return _child(0, json.dumps(RESULTS))(cmd, *args, **kw)

    monkeypatch.setattr(child, "run", run)
    lmeval.run_vllm(tmp_path, ["hellaswag_local"], None, "float16", 60, {"hellaswag_local": [0, 5, 9]})
    cmd = seen[0]
    assert json.loads(cmd[cmd.index("--samples") + 1]) == {"hellaswag_local": [0, 5, 9]} and "--limit" not in cmd
