"""Reliability on tiny models: every bad input is refused before weights load, with a message saying what to change;
disk full and a second writer leave nothing half-written; out of memory names the knobs."""

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from pipeline import cli
from quantize import calib, lock, runner
from quantize.export import write as export
from quantize.preflight import checks as preflight
from quantize.source import ModelSourceError, load as source
from tests.conftest import build_tiny_model, tiny_recipe


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if the run gets as far as loading weights: every check here must come before that."""
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the check")

    monkeypatch.setattr(source, "load_model", refuse)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _leftovers(root):
    """Anything a run may leave next to the artifact: temp dirs, old dirs, checkpoints, lock files (a released
    lock removes its file)."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") or p.suffix == ".lock")


def _held(lock_file):
    probe = subprocess.run([sys.executable, "-c", "import sys; from filelock import FileLock; "
                            "FileLock(sys.argv[1], timeout=0).acquire()", str(lock_file)], capture_output=True)
    return probe.returncode != 0


# --- free disk ---------------------------------------------------------------------------------------------

def test_too_little_disk_refused_before_weights(tiny_llama, tmp_path, monkeypatch, no_weights):
    need = {}
    real = shutil.disk_usage

    def small(path):
        need["path"] = path
        return real(path)._replace(free=123_456)

    monkeypatch.setattr(preflight.shutil, "disk_usage", small)
    with pytest.raises(runner.PreflightError,
                       match=r"needs about [\d.]+ MB .* has 123.46 KB free; free some space .* --out DIR"):
        runner.run(tiny_recipe(tmp_path, tiny_llama, method="rtn"), out_root=tmp_path / "a" / "b")
    assert need["path"] == tmp_path / "a" / "b"  # the disk of the output's parent (created for the lock)
    assert _leftovers(tmp_path / "a" / "b") == []  # the lock is released when pre-flight refuses


@pytest.mark.parametrize("fmt,zp", [("awq", True), ("gptq", False), ("compressed-tensors", True)])
def test_size_estimate_matches_the_artifact(tiny_llama, tmp_path, fmt, zp):
    out = runner.run(tiny_recipe(tmp_path, tiny_llama, name=f"est-{fmt}", method="rtn", format=fmt,
                                 zero_point=zp), out_root=tmp_path / "a")
    estimate = json.loads((out / "preflight.json").read_text())["tensor_bytes"]
    actual = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert abs(estimate - actual) / actual < 0.02, (estimate, actual)


# --- calibration length ------------------------------------------------------------------------------------

def test_short_calibration_text_refused_before_weights(tiny_llama, tmp_path, no_weights):
    text = tmp_path / "short.txt"
    text.write_text("A few words of calibration text.\n\nAnd a second paragraph.\n")
    recipe = tiny_recipe(tmp_path, tiny_llama, calibration=dict(dataset=str(text), n_samples=16, seq_len=64))
    with pytest.raises(calib.CalibrationError,
                       match=r"has \d+ tokens but n_samples x seq_len = 16 x 64 = 1024; lower calibration.n_samples"):
        runner.run(recipe, out_root=tmp_path / "a")


def test_calibration_samples_are_the_ones_make_samples_gives(tiny_llama, tmp_path):
    """Tokenizing in pre-flight changes nothing: the manifest's samples are those of the calibration recipe."""
    from transformers import AutoTokenizer

    out = runner.run(tiny_recipe(tmp_path, tiny_llama, name="calib-same", awq=dict(n_grid=2, clip_grid=2)),
                     out_root=tmp_path / "a")
    rec = json.loads((out / "manifest.json").read_text())["calibration"]
    ids = calib.make_samples(calib.load_text("groups-merged").documents, AutoTokenizer.from_pretrained(tiny_llama),
                             16, 64, 0)
    import hashlib

    assert rec["samples_sha256"] == hashlib.sha256(ids.numpy().tobytes()).hexdigest()


# --- tied embeddings ---------------------------------------------------------------------------------------

def test_tied_embeddings_stay_tied_and_unwritten(tmp_path):
    from transformers import AutoConfig

    from eval.artifact import load_dequantized

    d = build_tiny_model(tmp_path / "tied", "llama", layers=1, tie=True)
    out = runner.run(tiny_recipe(tmp_path, d, name="tied", method="rtn"), out_root=tmp_path / "a")
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        keys = set(st.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert not any(k.startswith("lm_head.") for k in keys)  # not quantized either
    cfg = AutoConfig.from_pretrained(out)  # what vLLM reads: it ties lm_head to embed_tokens
    assert cfg.tie_word_embeddings is True
    assert "lm_head" in cfg.quantization_config["modules_to_not_convert"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["tie_word_embeddings"] is True
    assert json.loads((out / "preflight.json").read_text())["tied_embeddings"] is True
    model = load_dequantized(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_untied_model_reports_untied(tiny_llama):
    from transformers import AutoConfig

    from quantize.source.arch import arch_for
    from quantize.formats import is_skipped
    from quantize.recipe import Recipe

    cfg = AutoConfig.from_pretrained(tiny_llama)
    the_plan = preflight.plan(cfg, arch_for(cfg), Recipe(name="x", model=str(tiny_llama), method="rtn",
                                                         q_group_size=64), is_skipped)
    assert the_plan.tied_embeddings is False and "lm_head tied" not in the_plan.summary()


# --- custom code ---------------------------------------------------------------------------------------------

CUSTOM_CONFIG = """
from pathlib import Path
from transformers import LlamaConfig
Path({marker!r}).write_text("custom code ran")

class TinyCustomConfig(LlamaConfig):
    pass
"""
CUSTOM_MODEL = """
from transformers import LlamaForCausalLM
from .configuration_custom import TinyCustomConfig

class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


def _custom_code_dir(tiny_llama, tmp_path):
    d = _copy(tiny_llama, tmp_path / "custom")
    marker = tmp_path / "custom-code-ran"
    (d / "configuration_custom.py").write_text(CUSTOM_CONFIG.format(marker=str(marker)))
    (d / "modeling_custom.py").write_text(CUSTOM_MODEL)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_custom.TinyCustomConfig",
                       "AutoModelForCausalLM": "modeling_custom.TinyCustomForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d, marker


def test_custom_code_refused_unless_trusted(tiny_llama, tmp_path, no_weights):
    d, marker = _custom_code_dir(tiny_llama, tmp_path)
    with pytest.raises(ModelSourceError,
                       match=r"ships custom Python code \(config.json auto_map .*configuration_custom.*"
                             r"set `trust_remote_code: true` in the recipe"):
        runner.run(tiny_recipe(tmp_path, d, name="custom", method="rtn"), out_root=tmp_path / "a")
    assert not marker.exists()
    # named by the recipe, the code runs (here: the plan, which builds the custom class on the meta device)
    report = runner.preflight_only(tiny_recipe(tmp_path, d, name="custom-ok", method="rtn", trust_remote_code=True),
                                   out_root=tmp_path / "a")
    assert marker.read_text() == "custom code ran" and "14 linears to convert" in report


def test_trust_flag_not_needed_for_supported_architecture(tiny_llama, tmp_path, caplog):
    report = runner.preflight_only(tiny_recipe(tmp_path, tiny_llama, name="trusting", method="rtn",
                                               trust_remote_code=True), out_root=tmp_path / "a")
    assert "14 linears to convert" in report
    assert "trust_remote_code: true but" in caplog.text and "not needed" in caplog.text


# --- pickle weights ----------------------------------------------------------------------------------------

class _Payload:
    """Unpickling this creates a file: proof that a pickle was (not) loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_only_checkpoint_refused(tiny_llama, tmp_path, no_weights, name):
    d = _copy(tiny_llama, tmp_path / "pickled")
    marker = tmp_path / "unpickled"
    (d / "model.safetensors").unlink()
    (d / name).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ModelSourceError, match=rf"only pickle weights \({name}\).*convert the checkpoint to "
                                                      r"safetensors"):
        runner.run(tiny_recipe(tmp_path, d, method="rtn"), out_root=tmp_path / "a")
    assert not marker.exists()


def test_pickle_next_to_safetensors_is_ignored(tiny_llama, tmp_path, caplog):
    d = _copy(tiny_llama, tmp_path / "both")
    marker = tmp_path / "unpickled"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    out = runner.run(tiny_recipe(tmp_path, d, name="both", method="rtn"), out_root=tmp_path / "a")
    assert (out / "model.safetensors").is_file() and not marker.exists()
    assert "ignoring pickle files pytorch_model.bin" in caplog.text


# --- output present, lock ----------------------------------------------------------------------------------

def test_existing_output_refused_before_weights_and_force_replaces(tiny_llama, tmp_path, monkeypatch):
    recipe = tiny_recipe(tmp_path, tiny_llama, name="again", method="rtn")
    first = runner.run(recipe, out_root=tmp_path / "a")
    with monkeypatch.context() as m:
        m.setattr(source, "load_model", lambda *a, **k: pytest.fail("weights loaded before the output check"))
        with pytest.raises(export.OutputExistsError, match="already exists; remove it or pass --force"):
            runner.run(recipe, out_root=tmp_path / "a")
    (first / "marker").write_text("old")
    again = runner.run(recipe, out_root=tmp_path / "a", force=True)
    assert again == first and not (again / "marker").exists() and _leftovers(tmp_path / "a") == []


HOLDER = """
import sys, time
from quantize.lock import output_lock
with output_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_second_writer_refused_while_first_holds_the_lock(tiny_llama, tmp_path, no_weights):
    out_root = tmp_path / "a"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out_root / "locked")], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(lock.OutputLockedError, match=rf"output .*locked is locked by another run: pid {proc.pid}"):
            runner.run(tiny_recipe(tmp_path, tiny_llama, name="locked", method="rtn"), out_root=out_root)
        assert (out_root / "locked.lock").is_file() and not (out_root / "locked").exists()
    finally:
        proc.kill()
        proc.wait()


def test_lock_held_during_run_and_left_lock_file_reused(tiny_llama, tmp_path, monkeypatch):
    """A lock file left by a killed run (here: a dead pid's record) is just a file: the next run takes the lock."""
    out_root = tmp_path / "a"
    out_root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (out_root / "stale.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    seen = {}
    real = source.load_model

    def spy(*a, **k):
        seen.update(json.loads((out_root / "stale.lock").read_text()))
        seen["held"] = _held(out_root / "stale.lock")
        return real(*a, **k)

    monkeypatch.setattr(source, "load_model", spy)
    runner.run(tiny_recipe(tmp_path, tiny_llama, name="stale", method="rtn"), out_root=out_root)
    assert seen["pid"] == os.getpid() and seen["held"]  # held by this run while it worked
    assert _leftovers(out_root) == [] and not (out_root / "stale.lock").exists()  # released and removed at the end


# --- disk full during export -------------------------------------------------------------------------------

def _fill_disk(monkeypatch):
    """safetensors writes part of a shard, then the disk is full."""
    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(export, "save_file", save_file)


def test_disk_full_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    _fill_disk(monkeypatch)
    out_root = tmp_path / "a"
    with pytest.raises(export.DiskFullError, match=rf"disk is full on {out_root}.*4.10 KB written.*"
                                                   r"partial files were removed and .* was not created"):
        runner.run(tiny_recipe(tmp_path, tiny_llama, name="full", method="rtn"), out_root=out_root)
    assert _leftovers(out_root) == [] and not (out_root / "full").exists()


def test_disk_full_with_force_keeps_previous_artifact(tiny_llama, tmp_path, monkeypatch):
    recipe = tiny_recipe(tmp_path, tiny_llama, name="keep", method="rtn")
    out = runner.run(recipe, out_root=tmp_path / "a")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fill_disk(monkeypatch)
    with pytest.raises(export.DiskFullError, match=rf"the previous {out} is untouched"):
        runner.run(recipe, out_root=tmp_path / "a", force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path / "a") == []


# --- out of memory -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("err", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("CUDA error: out of memory"),
                                 RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 9 GB")])
def test_out_of_memory_names_the_knobs(tiny_llama, tmp_path, monkeypatch, capsys, err):
    def oom(*a, **k):
        raise err

    monkeypatch.setattr(runner, "run", oom)
    rc = cli.main(["run", str(tiny_recipe(tmp_path, tiny_llama)), "--out", str(tmp_path / "a")])
    msg = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in msg
    assert "error: out of memory" in msg and str(err).splitlines()[0] in msg
    for knob in ("`batch_size`", "`calibration.n_samples`", "`calibration.seq_len`", "`device: cpu`",
                 "now: batch_size 4, calibration.n_samples 16, calibration.seq_len 64"):
        assert knob in msg


def test_other_runtime_errors_keep_their_traceback(tiny_llama, tmp_path, monkeypatch):
    def bug(*a, **k):
        raise RuntimeError("shape mismatch in a bug")

    monkeypatch.setattr(runner, "run", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.main(["run", str(tiny_recipe(tmp_path, tiny_llama)), "--out", str(tmp_path / "a")])


def test_cli_user_errors_exit_2(tiny_llama, tmp_path, monkeypatch, capsys):
    """The new errors (lock, disk full) print one line, no traceback, like every error a user can cause."""
    for err in (lock.OutputLockedError("output x is locked by another run: pid 1"),
                export.DiskFullError("the disk is full on /x")):
        monkeypatch.setattr(runner, "run", lambda *a, _e=err, **k: (_ for _ in ()).throw(_e))
        assert cli.main(["run", str(tiny_recipe(tmp_path, tiny_llama)), "--out", str(tmp_path / "a")]) == 2
        assert capsys.readouterr().err.strip() == f"error: {err}"


# --- model path, device ------------------------------------------------------------------------------------

def test_model_path_and_config_checked_first(tmp_path, no_weights):
    with pytest.raises(ModelSourceError, match=r"directory .*nowhere does not exist; fix the path"):
        runner.run(tiny_recipe(tmp_path, tmp_path / "nowhere", name="nowhere"), out_root=tmp_path / "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match=r"directory .*empty has no config.json"):
        runner.run(tiny_recipe(tmp_path, tmp_path / "empty", name="empty"), out_root=tmp_path / "a")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_without_cuda(tiny_llama, tmp_path, no_weights):
    with pytest.raises(runner.PreflightError, match="no CUDA device is visible; use device: auto or cpu"):
        runner.run(tiny_recipe(tmp_path, tiny_llama, name="cuda", device="cuda"), out_root=tmp_path / "a")


@pytest.mark.vllm
def test_vllm_serves_tied_artifact_like_our_decoding(tmp_path):
    """vLLM ties lm_head to embed_tokens from config.json alone: its logprobs match our decoding."""
    from eval.agreement import hf_logprobs, prompt_logprob_delta
    from eval.artifact import load_dequantized
    from eval.vllm_run import run_vllm

    d = build_tiny_model(tmp_path / "tied", "llama", tie=True)
    out = runner.run(tiny_recipe(tmp_path, d, name="tied-vllm"), out_root=tmp_path / "a")
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 512, (24,), generator=g).tolist() for _ in range(3)]
    res = run_vllm(out, ids, top_k=5, max_tokens=4)
    delta = prompt_logprob_delta(res["prompt_logprobs"], hf_logprobs(load_dequantized(out, torch.float32), ids))
    assert delta["mean_abs_delta"] < 0.01, delta
