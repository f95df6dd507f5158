"""The GPTQ kernel pre-compile child: when it starts, that it starts before torch is imported, what the run
learns from it, and that the child's own calls run (on the CPU, Triton under its interpreter)."""

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from quantize import precompile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_child_left():
    yield
    precompile._stop()


def test_spawn_only_for_run_or_compare_on_a_gpu_host(monkeypatch):
    monkeypatch.setattr(precompile, "gpu_visible", lambda: False)
    assert precompile.spawn(["run", "smollm2-gptq-g64"]) is None  # this machine: no NVIDIA device
    monkeypatch.setattr(precompile, "gpu_visible", lambda: True)
    assert precompile.spawn(["list"]) is None
    assert precompile.spawn([]) is None
    for off in ("0", "off", "False"):
        monkeypatch.setenv(precompile.ENV, off)
        assert precompile.spawn(["run", "smollm2-gptq-g64"]) is None
    assert precompile._child is None


def test_a_mistyped_switch_stops_the_command_with_what_to_set(tmp_path):
    # before any model (or torch) is loaded: the CLI's user-error exit code, nothing written
    p = subprocess.run([sys.executable, "-m", "quantize", "run", "smollm2-gptq-g64", "--out", str(tmp_path / "a")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **{precompile.ENV: "of"}))
    assert p.returncode == 2
    assert "QUANTIZE_PRECOMPILE='of' is not understood; set it to 0" in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_visible_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(precompile.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not precompile.gpu_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert precompile.gpu_visible()
    monkeypatch.setattr(precompile.os.path, "exists", lambda p: False)
    monkeypatch.setattr(precompile.glob, "glob", lambda p: [])
    assert not precompile.gpu_visible()


def test_spawned_child_on_a_cpu_host_compiles_nothing_and_says_why(monkeypatch, caplog, tmp_path):
    # the real child process, started as the CLI starts it (from another directory); here torch sees no CUDA device
    monkeypatch.setattr(precompile, "gpu_visible", lambda: True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    child = precompile.spawn(["run", "smollm2-gptq-g64", "--force"])
    assert child is not None and child.args[1:3] == ["-m", "quantize.precompile"]
    with caplog.at_level(logging.INFO, logger="quantize.precompile"):
        precompile.wait()
    assert precompile.outcome["rc"] == 0
    assert "nothing to compile (1 GPTQ recipes, device cpu)" in precompile.outcome["said"]
    assert "pre-compile: nothing to compile" in caplog.text
    assert precompile._child is None
    precompile.wait()  # nothing left to wait for


def test_child_with_a_bad_recipe_leaves_the_error_to_the_run(monkeypatch):
    monkeypatch.setattr(precompile, "gpu_visible", lambda: True)
    precompile.spawn(["run", "no-such-recipe"])
    precompile.wait()
    assert precompile.outcome["rc"] == 0 and precompile.outcome["said"].startswith("nothing compiled:")


def _fake_child(code: str) -> None:
    precompile._stderr = tempfile.TemporaryFile()
    precompile._child = subprocess.Popen([sys.executable, "-c", code], stderr=precompile._stderr)


def test_a_failed_child_is_a_warning_not_an_error(caplog):
    _fake_child("import sys; sys.stderr.write('ptxas exploded'); sys.exit(3)")
    with caplog.at_level(logging.WARNING, logger="quantize.precompile"):
        precompile.wait()
    assert precompile.outcome["rc"] == 3
    assert "pre-compile failed (exit 3; the run compiles it itself): ptxas exploded" in caplog.text


def test_a_slow_child_is_killed_after_the_wait_limit(caplog):
    _fake_child("import time; time.sleep(60)")
    child = precompile._child
    with caplog.at_level(logging.WARNING, logger="quantize.precompile"):
        precompile.wait(timeout=0.5)
    assert child.poll() is not None  # killed, not left running
    assert precompile.outcome["rc"] is None and "still running after 0 s" in caplog.text
    assert precompile._child is None


@pytest.mark.parametrize("out, rc, expected", [
    ("Default\nDefault\n", 0, False), ("Default\nExclusive_Process\n", 0, True), ("", 0, None), ("Default\n", 9, None)])
def test_exclusive_compute_reads_nvidia_smi(monkeypatch, out, rc, expected):
    monkeypatch.setattr(precompile.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, rc, stdout=out, stderr=""))
    assert precompile.exclusive_compute() is expected


def test_exclusive_compute_without_nvidia_smi(monkeypatch):
    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(precompile.subprocess, "run", missing)
    assert precompile.exclusive_compute() is None


MAIN_ORDER = """
import runpy, sys
import quantize.precompile as p
seen = []
p.spawn = lambda argv: seen.append(("torch" in sys.modules, argv))
sys.argv = ["quantize", "list"]
try:
    runpy.run_module("quantize", run_name="__main__")
except SystemExit:
    pass
print(seen)
"""


def test_the_command_line_spawns_before_importing_torch():
    p = subprocess.run([sys.executable, "-c", MAIN_ORDER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[(False, ['list'])]"


CHILD_ON_CPU = """
import sys
from quantize import precompile
sys.exit(precompile.main(["run", sys.argv[1]], allow_cpu=True))
"""


def test_child_runs_the_sweep_calls_for_the_runs_specs(tmp_path):
    # what the child does on a GPU host, on the CPU: the recipe's GPTQ spec with the Triton sweep (interpreted)
    pytest.importorskip("triton")
    recipe = tmp_path / "tiny-gptq.yaml"
    recipe.write_text((ROOT / "recipes/smollm2-gptq-g64.yaml").read_text()
                      .replace("name: smollm2-gptq-g64", "name: tiny-gptq")
                      .replace("block_size: 128", "block_size: 128\n  kernel: triton"))
    p = subprocess.run([sys.executable, "-c", CHILD_ON_CPU, str(recipe)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stderr
    assert "compiled the GPTQ sweep for 1 recipe(s) on cpu" in p.stderr, p.stderr
