"""Per-layer checkpoints: a run killed with SIGKILL mid-pass resumes at its last saved layer and writes the
same bytes as an uninterrupted run; a checkpoint of a different run is discarded, never mixed in."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from quantize import runner
from quantize.capture.loop import LayerData
from tests.conftest import build_tiny_model, tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
N_LAYERS = 8


@pytest.fixture(scope="module")
def deep_qwen2(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("deep"), "qwen2", layers=N_LAYERS)


def _cmd(recipe: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "pipeline", "run", str(recipe), "--out", str(out), "--no-eval"]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _no_seconds(x):
    """Stats without their timings (which differ between any two runs)."""
    if isinstance(x, dict):
        return {k: _no_seconds(v) for k, v in x.items() if k != "seconds"}
    return x


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_killed_run_resumes_and_writes_identical_files(deep_qwen2, tmp_path, method):
    over = dict(method="gptq", zero_point=False) if method == "gptq" else {}
    recipe = tiny_recipe(tmp_path, deep_qwen2, name=f"resume-{method}", checkpoint_every_s=0,
                         calibration=dict(dataset="groups-merged", n_samples=32, seq_len=128, seed=0), **over)
    ref = subprocess.run(_cmd(recipe, tmp_path / "ref"), env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]

    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(recipe, out), env=_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # a real SIGKILL right after the third layer's checkpoint
        seen.append(line)
        if "checkpoint: layers 1-3 saved" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-20:])
    ckpt = out / f".resume-{method}.checkpoint"
    assert not (out / f"resume-{method}").exists() and (ckpt / "state.json").is_file()
    assert json.loads((ckpt / "state.json").read_text())["next_layer"] >= 3

    again = subprocess.run(_cmd(recipe, out), env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from checkpoint" in again.stderr and f"layer 1/{N_LAYERS} done" not in again.stderr
    a, b = _files(tmp_path / "ref" / f"resume-{method}"), _files(out / f"resume-{method}")
    assert a.keys() == b.keys()
    differ = [n for n in a if a[n] != b[n]]
    assert differ == ["manifest.json"], differ  # only timings differ; every weight/config/card byte is equal
    ma, mb = json.loads(a["manifest.json"]), json.loads(b["manifest.json"])
    assert ma["files"] == mb["files"] and _no_seconds(ma[f"{method}_stats"]) == _no_seconds(mb[f"{method}_stats"])
    assert not ckpt.exists()  # cleared once the artifact is in place


def test_checkpoint_of_another_run_is_discarded(deep_qwen2, tmp_path, monkeypatch, caplog):
    """Crash (fault injection) after layer 4 of one recipe, then change the recipe: the stale checkpoint must be
    discarded and the result equal a clean run of the changed recipe."""
    from quantize.methods import job

    first = tiny_recipe(tmp_path, deep_qwen2, name="ck", checkpoint_every_s=0)
    real = job.Job.process

    def crash_at_5(self, data: LayerData):
        if data.index == 4:
            raise RuntimeError("injected crash")
        return real(self, data)

    monkeypatch.setattr(job.Job, "process", crash_at_5)
    with pytest.raises(RuntimeError, match="injected crash"):
        runner.run(first, out_root=tmp_path / "o")
    assert json.loads((tmp_path / "o" / ".ck.checkpoint" / "state.json").read_text())["next_layer"] == 4
    monkeypatch.setattr(job.Job, "process", real)

    changed = tiny_recipe(tmp_path, deep_qwen2, name="ck", checkpoint_every_s=0, awq=dict(n_grid=5, clip_grid=5))
    with caplog.at_level("WARNING"):
        got = runner.run(changed, out_root=tmp_path / "o")
    assert "belongs to a different run" in caplog.text
    clean = runner.run(changed, out_root=tmp_path / "clean")
    assert (got / "model.safetensors").read_bytes() == (clean / "model.safetensors").read_bytes()


def _crash_after_layer_4(monkeypatch, recipe, out_root):
    from quantize.methods import job

    real = job.Job.process

    def crash_at_5(self, data: LayerData):
        if data.index == 4:
            raise RuntimeError("injected crash")
        return real(self, data)

    with monkeypatch.context() as m:
        m.setattr(job.Job, "process", crash_at_5)
        with pytest.raises(RuntimeError, match="injected crash"):
            runner.run(recipe, out_root=out_root)


def _damage(ckpt: Path, what: str) -> None:
    state = json.loads((ckpt / "state.json").read_text())
    if what == "state.json":
        (ckpt / "state.json").write_text('{"fingerprint": "')
    else:
        f = ckpt / (state["layer_files"][-1] if what == "layer file" else state["carry"])
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.parametrize("what", ["state.json", "layer file", "carry file"])
def test_damaged_checkpoint_is_discarded_and_the_run_restarts(deep_qwen2, tmp_path, monkeypatch, caplog, what):
    """A truncated or garbled checkpoint of our own is not worth a failing rerun: it is discarded with a warning."""
    recipe = tiny_recipe(tmp_path, deep_qwen2, name="dmg", checkpoint_every_s=0, awq=dict(n_grid=2, clip_grid=2))
    _crash_after_layer_4(monkeypatch, recipe, tmp_path / "o")
    ckpt = tmp_path / "o" / ".dmg.checkpoint"
    _damage(ckpt, what)
    with caplog.at_level("WARNING"):
        got = runner.run(recipe, out_root=tmp_path / "o")
    assert f"checkpoint {ckpt} cannot be read" in caplog.text and "discarding it and starting from layer 1" in caplog.text
    clean = runner.run(recipe, out_root=tmp_path / "clean")
    assert (got / "model.safetensors").read_bytes() == (clean / "model.safetensors").read_bytes()
    assert not ckpt.exists()


def test_disk_full_while_saving_a_checkpoint(deep_qwen2, tmp_path, monkeypatch, capsys, caplog):
    """torch.save reports a full disk as a RuntimeError (the OSError is its context): one line, the last complete
    checkpoint kept, and the rerun resumes from it."""
    import errno

    from pipeline import cli
    from quantize.capture import checkpoint

    recipe = tiny_recipe(tmp_path, deep_qwen2, name="full", checkpoint_every_s=0, awq=dict(n_grid=2, clip_grid=2))
    real, calls = checkpoint.torch.save, []

    def save(obj, f):
        calls.append(1)
        if len(calls) <= 2:  # layer 1's two files fit
            return real(obj, f)
        f.write(b"\0" * 100)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534") from None

    monkeypatch.setattr(checkpoint.torch, "save", save)
    rc = cli.main(["run", str(recipe), "--out", str(tmp_path / "o"), "--no-eval"])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 2 and "Traceback" not in err and len(line) == 1
    ckpt = tmp_path / "o" / ".full.checkpoint"
    assert f"disk is full on {tmp_path / 'o'} while saving the resume checkpoint {ckpt} after layer 2" in line[0]
    assert "layers 1-1 stay saved, and a rerun resumes from there" in line[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["carry-00001.pt", "layers-00000-00001.pt", "state.json"]
    monkeypatch.setattr(checkpoint.torch, "save", real)
    caplog.clear()
    with caplog.at_level("INFO"):
        assert cli.main(["run", str(recipe), "--out", str(tmp_path / "o"), "--no-eval"]) == 0
    assert f"resuming from checkpoint {ckpt}: layers 1-1 already done" in caplog.text
    assert (tmp_path / "o" / "full" / "model.safetensors").is_file() and not ckpt.exists()


def test_a_resumed_run_that_writes_during_the_pass_writes_the_restored_layers_too(deep_qwen2, tmp_path, monkeypatch,
                                                                                   caplog):
    """Weights written while the pass runs (as on CUDA; forced on the CPU here): the crashed run's half-written
    directory is removed, and the resumed run writes the layers it restored before the ones it computes, so its
    shards equal a clean run's written at export."""
    recipe = tiny_recipe(tmp_path, deep_qwen2, name="wdp", checkpoint_every_s=0, max_shard_size="300KB",
                         awq=dict(n_grid=2, clip_grid=2))
    monkeypatch.setattr(runner, "WRITE_DURING_PASS", {"cpu"})
    _crash_after_layer_4(monkeypatch, recipe, tmp_path / "o")
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [".wdp.checkpoint"]  # no temporary directory left
    with caplog.at_level("INFO"):
        got = runner.run(recipe, out_root=tmp_path / "o")
    assert "resuming from checkpoint" in caplog.text
    monkeypatch.setattr(runner, "WRITE_DURING_PASS", set())
    clean = runner.run(recipe, out_root=tmp_path / "clean")
    shards = sorted(p.name for p in clean.glob("model*"))
    assert len(shards) > 2 and shards == sorted(p.name for p in got.glob("model*"))
    assert all((got / s).read_bytes() == (clean / s).read_bytes() for s in shards)
