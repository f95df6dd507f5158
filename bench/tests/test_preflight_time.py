"""bench/preflight_time.py's checkpoint: weight files that hold headers only, which pre-flight accepts as whole."""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from bench.build_checkpoint import ROOT
from bench.preflight_time import headers_only


def test_headers_only_checkpoint_passes_the_integrity_check(tmp_path):
    from quantize.source import integrity, load as source
    from quantize.source.arch import arch_for

    out = tmp_path / "ckpt"
    made = headers_only(ROOT / "bench" / "configs" / "qwen2.5-7b", out, tiny=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == made["tensors"] and index["metadata"]["total_size"] == made["bytes"]
    for fname in set(index["weight_map"].values()):
        path = out / fname
        assert os.stat(path).st_blocks * 512 < path.stat().st_size  # the data is a hole, not written bytes
        with safe_open(str(path), "pt") as f:  # a header and data size that safetensors accepts as a file
            assert set(f.keys()) == {n for n, v in index["weight_map"].items() if v == fname}
    src = source.resolve(str(out))
    config = source.read_config(src)
    integrity.check_tensors(src, config, arch_for(config))  # every tensor the config implies, shaped as it says


def test_same_process_calls_report_each_pre_flight(tmp_path):
    """--same-process: pre-flight called again in one process reports one entry per call, each with its stage."""
    import subprocess
    import sys

    import yaml

    from bench.preflight_time import SAME_PROCESS

    headers_only(ROOT / "bench" / "configs" / "qwen2.5-7b", tmp_path / "ckpt", tiny=True)
    recipe = yaml.safe_load((ROOT / "recipes" / "qwen7b-awq-g128.yaml").read_text())
    recipe.update(model=str(tmp_path / "ckpt"), device="cpu",
                  calibration={"dataset": "groups-merged", "n_samples": 4, "seq_len": 32})
    path = tmp_path / "qwen7b-awq-g128.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    (tmp_path / "s").mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", SAME_PROCESS, str(path), str(tmp_path / "s"), "2"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    calls = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(calls) == 2 and all(c["preflight_s"] >= 0 and c["call_s"] > 0 for c in calls)
    assert (tmp_path / "s" / "plan-0.json").is_file() and (tmp_path / "s" / "plan-1.json").is_file()


def test_the_stage_parts_line_is_read_back(caplog):
    """The record's parts come from the line `runlog.Timings` logs at the end of a stage with laps."""
    import logging

    from bench.preflight_time import parts
    from quantize.runlog import Timings

    t = Timings()
    with caplog.at_level(logging.INFO, logger="quantize.runlog"), t.stage("preflight"):
        lap = t.laps("preflight")
        lap("config")
        lap("eval inputs")
        lap("config")  # a part met twice adds up
    assert list(t.parts["preflight"]) == ["config", "eval inputs"]
    assert parts(caplog.text) == {k: round(v, 1) for k, v in t.parts["preflight"].items()}
    assert parts("stage preflight: done in 3.4 s\n") == {}


def test_against_a_directory_that_is_no_tree_is_one_line_and_exit_2(tmp_path):
    """--against DIR with no pipeline/__main__.py is refused before any checkpoint is built."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(ROOT / "bench" / "preflight_time.py"), "--against", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "holds no pipeline/__main__.py" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_a_tree_is_timed_as_a_fresh_process():
    """timed() runs `python -m pipeline ARGS` with the tree as its code and gives its wall seconds and output."""
    from bench.preflight_time import commit, timed

    wall, log = timed(ROOT, ["list"], "list")
    assert wall > 0 and "smollm2-awq-g64" in log
    assert commit(ROOT)
