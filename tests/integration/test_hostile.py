"""Hostile names, faulty disks and signals on a tiny Llama: one `error:` line, exit 2, nothing half-written, the
previous artifacts intact."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from pipeline import cli
from quantize import runner
from quantize.export import write as export
from tests.conftest import ROOT, tiny_recipe


def _cli(capsys, *argv) -> tuple[int, str]:
    """Run the command line -> (exit code, stderr's one error line); fails unless there is exactly one."""
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    assert "\n" not in lines[0]
    return rc, lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root (lock files aside: a killed run's stays until the next run of its output) -> bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix != ".lock"}


@pytest.fixture(scope="module")
def previous(tiny_llama, tmp_path_factory):
    """An artifacts directory holding one finished artifact, to be copied by each test that needs one."""
    tmp = tmp_path_factory.mktemp("previous")
    runner.run(tiny_recipe(tmp, tiny_llama, name="keep", method="rtn"), out_root=tmp / "artifacts")
    return tmp / "artifacts"


def _artifacts(previous, tmp_path) -> Path:
    import shutil

    shutil.copytree(previous, tmp_path / "artifacts")
    return tmp_path / "artifacts"


# --- names from recipes and flags --------------------------------------------------------------------------

@pytest.mark.parametrize("name", [".", ".."])
def test_recipe_name_leaving_its_directory_refused(tiny_llama, previous, tmp_path, capsys, name):
    """`recipes/..yaml` is named `.`: with --force it would replace the whole artifacts directory."""
    arts = _artifacts(previous, tmp_path)
    before = _tree(tmp_path)
    recipe = tiny_recipe(tmp_path, tiny_llama, name=name, method="rtn")
    assert recipe.name == f"{name}.yaml"
    before = _tree(tmp_path)
    rc, msg = _cli(capsys, "run", recipe, "--out", arts, "--force", "--no-eval")
    assert rc == 2 and f"recipe name '{name}' does not name a file or directory inside {arts}" in msg
    assert "use a plain name" in msg
    assert _tree(tmp_path) == before
    rc, msg = _cli(capsys, "preflight", recipe, "--out", arts, "--force")
    assert rc == 2 and "does not name a file or directory inside" in msg


def test_register_name_leaving_its_directory_refused(previous, tmp_path, capsys):
    arts = _artifacts(previous, tmp_path)
    rc, msg = _cli(capsys, "register", "../../etc", "--out", arts)
    # register takes a recipe name or path: this one names no recipe, so no artifact outside --out is looked for
    assert rc == 2 and msg.startswith("error: no recipe named '../../etc'")


def test_compare_name_leaving_out_refused_before_work(tiny_llama, tmp_path, capsys):
    out = tmp_path / "deep" / "out"
    recipe = tiny_recipe(tmp_path, tiny_llama, name="cmp", method="rtn")
    rc, msg = _cli(capsys, "compare", recipe, "--name", "x/../../escaped", "--out", out, "--no-eval")
    assert rc == 2 and "comparison --name 'compare-x/../../escaped.json' does not name a file" in msg
    assert not (tmp_path / "deep" / "escaped.json").exists() and not (tmp_path / "escaped.json").exists()
    assert not (out / "cmp").exists()  # refused before anything was quantized


def test_out_pointing_at_a_file_refused(tiny_llama, tmp_path, capsys):
    (tmp_path / "afile").write_text("not a directory")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tofile", method="rtn")
    rc, msg = _cli(capsys, "run", recipe, "--out", tmp_path / "afile", "--no-eval")
    assert rc == 2 and f"--out {tmp_path / 'afile'}: {tmp_path / 'afile'} is a file, not a directory" in msg
    assert (tmp_path / "afile").read_text() == "not a directory"


def _unwritable_dir(tmp_path) -> Path:
    """A directory this process cannot create files in: mode 0555, or (root ignores modes) sysfs."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    for cand in (d, Path("/sys")):
        try:
            (cand / "probe").touch()
            (cand / "probe").unlink()
        except OSError:
            return cand
    pytest.skip("no unwritable directory here")


def test_read_only_output_directory_refused(tiny_llama, tmp_path, capsys):
    ro = _unwritable_dir(tmp_path)
    recipe = tiny_recipe(tmp_path, tiny_llama, name="ro", method="rtn")
    rc, msg = _cli(capsys, "run", recipe, "--out", ro, "--no-eval")
    assert rc == 2 and f"--out {ro}: {ro} is not writable by this user" in msg and "--out DIR" in msg


# --- faults during export ----------------------------------------------------------------------------------

def _safetensors_disk_full(monkeypatch):
    """safetensors writes part of a shard, then raises what it raises on a full disk (its own error type)."""
    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export, "save_file", save_file)


def test_safetensors_disk_full_is_the_disk_full_message(tiny_llama, previous, tmp_path, monkeypatch, capsys):
    arts = _artifacts(previous, tmp_path)
    before = _tree(arts)
    _safetensors_disk_full(monkeypatch)
    recipe = tiny_recipe(tmp_path, tiny_llama, name="keep", method="rtn")
    rc, msg = _cli(capsys, "run", recipe, "--out", arts, "--force", "--no-eval")
    assert rc == 2 and f"the disk is full on {arts} while writing the artifact (4.10 KB written when it failed: No " \
                       f"space left on device); the partial files were removed and the previous {arts / 'keep'} is " \
                       f"untouched" in msg
    assert _tree(arts) == before and not any(p.name.startswith(".") for p in arts.iterdir())


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_failed_final_rename_restores_previous_artifact(tiny_llama, previous, tmp_path, monkeypatch, capsys, code):
    arts = _artifacts(previous, tmp_path)
    before = _tree(arts)
    real = os.replace

    def replace(src, dst):
        if ".tmp-" in str(src):
            raise OSError(code, os.strerror(code), str(dst))
        return real(src, dst)

    monkeypatch.setattr(export.os, "replace", replace)
    recipe = tiny_recipe(tmp_path, tiny_llama, name="keep", method="rtn")
    rc, msg = _cli(capsys, "run", recipe, "--out", arts, "--force", "--no-eval")
    assert rc == 2 and f"the previous {arts / 'keep'} is untouched" in msg and os.strerror(code) in msg
    assert _tree(arts) == before and not any(p.name.startswith(".") for p in arts.iterdir())


def test_debug_shows_the_traceback(tiny_llama, tmp_path):
    (tmp_path / "afile").write_text("x")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="dbg", method="rtn")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        cli.main(["run", str(recipe), "--out", str(tmp_path / "afile"), "--debug"])


# --- signals during export ---------------------------------------------------------------------------------

# The wait is many short sleeps: the kernel hands a process-directed signal to any of the process's threads
# (torch's workers included), and Python runs its handler in the main thread only when that thread next
# executes bytecode, so one long C-level sleep would hold the handled signal back until it ends.
DRIVER = """
import sys, time
from pipeline import cli
from quantize.export.stream import WeightStream
real = WeightStream.finish
def slow(*a, **k):
    names = real(*a, **k)
    print("exporting", flush=True)
    for _ in range(1200):
        time.sleep(0.1)
    return names
WeightStream.finish = slow
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signal_during_export_leaves_nothing(tiny_llama, previous, tmp_path, sig):
    """Ctrl-C and SIGTERM: exit 2 with a message, temp removed, previous artifact intact. SIGKILL cannot be
    handled: its temp directory is removed by the next run of that output."""
    arts = _artifacts(previous, tmp_path)
    before = _tree(arts)
    recipe = tiny_recipe(tmp_path, tiny_llama, name="keep", method="rtn")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "run", str(recipe), "--out", str(arts), "--force",
                             "--no-eval"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "exporting"
    assert [p.name for p in arts.glob(".keep.tmp-*")]  # mid-export
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL and list(arts.glob(".keep.tmp-*"))
        runner.run(recipe, out_root=arts, force=True)  # the next run of that output cleans up
        assert not list(arts.glob(".*"))
        return
    name = signal.Signals(sig).name
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"error: interrupted by {name}; files being written were removed")
    assert _tree(arts) == before and not any(p.name.startswith(".") for p in arts.iterdir())


SWAP_DRIVER = """
import os, sys, time
from pathlib import Path
from pipeline import cli
real, where = os.replace, sys.argv.pop(1)
def replace(src, dst, *a, **k):  # the second rename of a --force swap moves the new artifact into place
    new = Path(src).name.startswith(".keep.tmp-")
    if new and where == "between":
        print(where, flush=True)
        time.sleep(120)
    real(src, dst, *a, **k)
    if new and where == "after":
        print(where, flush=True)
        time.sleep(120)
os.replace = replace
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["between", "after"])
def test_killed_force_swap_is_restored_or_finished(tiny_llama, previous, tmp_path, capsys, caplog, where):
    """SIGKILL between the two renames of --force leaves no `keep`, the previous one in `.keep.old-*` and the new
    one in `.keep.tmp-*`: the next command puts the previous one back. Killed after both renames, the next
    command finishes the swap. Either way it says which, and nothing hidden is left."""
    arts = _artifacts(previous, tmp_path)
    before = _tree(arts)
    recipe = tiny_recipe(tmp_path, tiny_llama, name="keep", method="rtn", q_group_size=128)  # differs from before
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", SWAP_DRIVER, where, "run", str(recipe), "--out", str(arts),
                             "--force", "--no-eval"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == where
    proc.kill()
    proc.communicate(timeout=60)
    left = sorted(p.name.split("-")[0] for p in arts.iterdir())
    assert left == ([".keep.old", ".keep.tmp", "keep.lock"] if where == "between" else [".keep.old", "keep", "keep.lock"])
    with caplog.at_level("WARNING"):
        rc, msg = _cli(capsys, "run", recipe, "--out", arts, "--no-eval")
    assert rc == 2 and msg.startswith(f"error: output {arts / 'keep'} already exists")
    assert sorted(p.name for p in arts.iterdir()) == ["keep"]  # no .old-, .tmp- or lock file
    if where == "between":
        assert f"a run of {arts / 'keep'} was killed while replacing it: put back the previous artifact from " \
               f".keep.old-" in caplog.text
        assert "removed .keep.tmp-" in caplog.text
        assert _tree(arts) == before
    else:
        assert f"a run of {arts / 'keep'} was killed after replacing it: finished the replacement by removing the " \
               f"previous artifact .keep.old-" in caplog.text
        assert "q_group_size: 128" in (arts / "keep" / "recipe.yaml").read_text()


def test_force_over_a_file_leaves_nothing_beside_it(tiny_llama, tmp_path):
    arts = tmp_path / "artifacts"
    arts.mkdir()
    (arts / "f").write_text("a file where the artifact goes")
    runner.run(tiny_recipe(tmp_path, tiny_llama, name="f", method="rtn"), out_root=arts, force=True)
    assert sorted(p.name for p in arts.iterdir()) == ["f"] and (arts / "f" / "manifest.json").is_file()


# --- the checkpoint against its config (before any weight loads) ------------------------------------------

def _edit_weights(d: Path, edit) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    f = d / "model.safetensors"
    with safe_open(str(f), "pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _edit_config(d: Path, **keys) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(keys)
    (d / "config.json").write_text(json.dumps(cfg))


def _broken(tiny_llama, tmp_path, how):
    import shutil

    import torch

    d = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    if how == "missing tensor":
        _edit_weights(d, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    elif how == "layer count":
        _edit_config(d, num_hidden_layers=3)
    elif how == "wrong shape":
        _edit_weights(d, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(256, 128)}))
    elif how == "unexpected tensor":
        _edit_weights(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(4, 4)}))
    elif how == "truncated safetensors":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "empty safetensors":
        (d / "model.safetensors").write_bytes(b"")
    elif how == "config not JSON":
        (d / "config.json").write_text('{"model_type": "llama",')
    elif how == "config unknown model_type":
        _edit_config(d, model_type="no-such-model")
    elif how == "config bad value":
        _edit_config(d, hidden_size="large")
    elif how == "missing tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (d / f).unlink(missing_ok=True)
    elif how == "corrupt tokenizer":
        (d / "tokenizer.json").write_bytes(bytes(range(256)) * 4)
    return d


CHECKPOINT_CASES = {
    "missing tensor": r"do not match config.json: 1 tensor\(s\) missing from the weights: "
                      r"model.layers.1.mlp.down_proj.weight\. transformers would fill missing tensors with random",
    "layer count": r"config.json num_hidden_layers is 3 but the weights hold 2 decoder layers \(model.layers.0 to "
                   r"model.layers.1\); 9 tensor\(s\) missing",
    "wrong shape": r"model.layers.0.self_attn.o_proj.weight has shape \[256, 128\] but config.json implies \[256, 256\]",
    "unexpected tensor": r"1 tensor\(s\) in the weights that the model does not have: model.layers.0.mlp.extra.weight",
    "truncated safetensors": r"model.safetensors is not a readable safetensors file \(SafetensorError: .*\): it is "
                             r"truncated or corrupt; re-download or re-export it",
    "empty safetensors": r"model.safetensors is not a readable safetensors file .*header too small",
    "config not JSON": r"config.json is not valid JSON",
    "config unknown model_type": r"config.json is not a usable transformers config \(ValueError: .*\); fix or "
                                 r"re-download it",
    "config bad value": r"config.json is not a usable transformers config \(StrictDataclassFieldValidationError: "
                        r"Validation error for field 'hidden_size'.*\); fix or re-download it",
    "missing tokenizer": r"the tokenizer in .* cannot be loaded \(.*\); restore its tokenizer files",
    "corrupt tokenizer": r"the tokenizer in .* cannot be loaded \(\w+: .*\); restore its tokenizer files",
}


@pytest.mark.parametrize("how,method", [(how, "rtn") for how in CHECKPOINT_CASES] +  # awq: calibration's path
                         [(how, "awq") for how in ("missing tensor", "missing tokenizer", "corrupt tokenizer")])
def test_checkpoint_must_match_its_config_before_weights(tiny_llama, tmp_path, monkeypatch, capsys, how, method):
    import re

    from quantize.source import load as source

    d = _broken(tiny_llama, tmp_path, how)
    monkeypatch.setattr(source, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    recipe = tiny_recipe(tmp_path, d, name="broken", method=method)
    rc, msg = _cli(capsys, "run", recipe, "--out", tmp_path / "artifacts", "--no-eval")
    assert rc == 2 and re.search(CHECKPOINT_CASES[how], msg), msg
    assert msg.startswith(f"error: model '{d}'")
    assert not (tmp_path / "artifacts" / "broken").exists()


def test_tied_checkpoint_without_lm_head_and_sharded_checkpoint_pass(tmp_path, tiny_qwen2):
    """What the check must accept: a tied lm_head absent from the files; an index and its shards."""
    import shutil

    from quantize.source import ModelSourceError, integrity, load as source
    from quantize.source.arch import arch_for
    from tests.conftest import build_tiny_model

    for d in (build_tiny_model(tmp_path / "tied", "llama", layers=1, tie=True), tiny_qwen2):
        src = source.resolve(str(d))
        cfg = source.read_config(src)
        integrity.check_tensors(src, cfg, arch_for(cfg))
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_qwen2).save_pretrained(sharded, max_shard_size="300KB")
    for f in ("config.json",):
        shutil.copy(tiny_qwen2 / f, sharded / f)
    assert (sharded / "model.safetensors.index.json").is_file()
    src = source.resolve(str(sharded))
    cfg = source.read_config(src)
    integrity.check_tensors(src, cfg, arch_for(cfg))
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelSourceError, match=rf"index.json lists shards that are not in .*: {shard.name}"):
        integrity.check_tensors(src, cfg, arch_for(cfg))


# --- GGUF --------------------------------------------------------------------------------------------------

def _gguf(path: Path, arch: str, strings: dict[str, str] | None = None) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (strings or {}).items():
        w.add_string(key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_refused_from_its_header(tiny_llama, tmp_path, monkeypatch, capsys):
    """Read from the header: no conversion, no hash of the whole file, nothing written."""
    from quantize.source import gguf, load as source
    from quantize.source.arch import GGUF_ARCHITECTURES, UnsupportedArchitecture

    cache = tmp_path / "cache"
    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(cache))
    monkeypatch.setattr(gguf, "_convert_gguf", lambda *a: pytest.fail("converted before refusing"))
    monkeypatch.setattr(gguf, "sha256_file", lambda *a: pytest.fail("hashed the whole file before refusing"))
    f = _gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(UnsupportedArchitecture, match="GGUF architecture 'gpt2'"):
        source.resolve(str(f))
    recipe = tiny_recipe(tmp_path, f, name="gg", method="rtn")
    rc, msg = _cli(capsys, "preflight", recipe, "--out", tmp_path / "a")
    assert rc == 2 and msg == (f"error: model '{f}': GGUF architecture 'gpt2' (general.architecture) is not "
                               f"supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    assert not cache.exists() and not (tmp_path / "a").exists()


def test_bad_gguf_is_one_line(tmp_path, monkeypatch, capsys, tiny_llama):
    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    for content in (b"", b"GGUF" + bytes(60), os.urandom(4096)):
        f = tmp_path / "bad.gguf"
        f.write_bytes(content)
        rc, msg = _cli(capsys, "preflight", tiny_recipe(tmp_path, f, name="bad", method="rtn"), "--out", tmp_path / "a")
        assert rc == 2 and msg.startswith(f"error: model '{f}': {f} is not a readable GGUF file (")
        assert msg.endswith("re-download it or point the recipe's `model` at another file")
    assert not (tmp_path / "cache").exists()


def test_damaged_gguf_cache_is_rebuilt(tiny_llama, tmp_path, monkeypatch, caplog):
    import shutil

    from quantize.source import gguf, load as source

    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    conversions = []

    def convert(gguf, into):  # what a conversion writes, without converting (the tiny model is not a GGUF)
        conversions.append(gguf)
        for p in tiny_llama.iterdir():
            shutil.copy(p, into / p.name)

    monkeypatch.setattr(gguf, "_convert_gguf", convert)
    f = _gguf(tmp_path / "m.gguf", "llama")
    first = source.resolve(str(f))
    assert first.kind == "gguf" and len(conversions) == 1
    assert source.resolve(str(f)).path == first.path and len(conversions) == 1  # cached
    weights = first.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a damaged cache
    with caplog.at_level("WARNING"):
        again = source.resolve(str(f))
    assert len(conversions) == 2 and again.path == first.path
    assert f"GGUF conversion cache {first.path} is damaged (SafetensorError" in caplog.text
    assert (again.path / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()


def test_gguf_converted_once_by_runs_side_by_side(tiny_llama, tmp_path, monkeypatch):
    """Two runs resolving one GGUF at the same time: one converts, the other waits and reads its cache (without
    the lock the second's rename met the first's finished directory: OSError, directory not empty)."""
    import shutil
    import threading
    import time

    from quantize.source import gguf, load as source

    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    conversions = []

    def convert(gguf, into):
        conversions.append(gguf)
        time.sleep(0.5)  # long enough for the other run to arrive while this one converts
        for p in tiny_llama.iterdir():
            shutil.copy(p, into / p.name)

    monkeypatch.setattr(gguf, "_convert_gguf", convert)
    f = _gguf(tmp_path / "m.gguf", "llama")
    found, errors = [], []

    def run():
        try:
            found.append(source.resolve(str(f)).path)
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(conversions) == 1
    assert found[0] == found[1] and (found[0] / "model.safetensors").is_file()
    assert [p.name for p in found[0].parent.iterdir() if p.name.startswith(f".{found[0].name}.")] == [
        f".{found[0].name}.lock"]  # no half-written temporary left beside it


# --- calibration files -------------------------------------------------------------------------------------

CALIB_CASES = {
    "calib.txt": (bytes(range(256)) * 64, r"calibration.dataset .*calib.txt is not UTF-8 text \(invalid start byte "
                                          r"at byte 128\); convert it to UTF-8"),
    "calib.jsonl": (b'{"text": "a document"}\n{"text": "unterminated\n',
                    r"calibration.dataset .*calib.jsonl cannot be read as JSON Lines \(one JSON object per line\): "
                    r"line 2 is not JSON \(Unterminated string .*\); fix the file"),
    "bin.jsonl": (b'{"text": "a document"}\n' + bytes(range(128, 256)),
                  r"bin.jsonl cannot be read as JSON Lines .*: line 2 is not UTF-8 \(invalid start byte at byte 0\)"),
}


@pytest.mark.parametrize("fname", list(CALIB_CASES))
def test_bad_calibration_file_is_one_line_before_weights(tiny_llama, tmp_path, monkeypatch, capsys, fname):
    import re

    from quantize.source import load as source

    content, pattern = CALIB_CASES[fname]
    (tmp_path / fname).write_bytes(content)
    monkeypatch.setattr(source, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    recipe = tiny_recipe(tmp_path, tiny_llama, name="cal", calibration=dict(dataset=str(tmp_path / fname),
                                                                            n_samples=4, seq_len=16))
    rc, msg = _cli(capsys, "run", recipe, "--out", tmp_path / "a", "--no-eval")
    assert rc == 2 and re.search(pattern, msg), msg
    assert not (tmp_path / "a" / "cal").exists()


# --- eval stage --------------------------------------------------------------------------------------------

def test_perplexity_window_longer_than_the_text(tiny_llama, tmp_path, monkeypatch, capsys):
    """Pre-flight tokenizes the eval text: a window longer than it is refused before any weight loads; the eval
    command on an existing artifact says the same."""
    from quantize.source import load as source

    text = tmp_path / "short.txt"
    text.write_text("Only a few words to score.\n")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="ev", method="rtn",
                         eval=dict(perplexity=dict(dataset=str(text), seq_len=2048), vllm=dict(enabled=False)))
    load = source.load_model
    monkeypatch.setattr(source, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    for cmd in ("run", "preflight"):
        rc, msg = _cli(capsys, cmd, recipe, "--out", tmp_path / "a")
        assert rc == 2 and re_match(r"error: ev: perplexity text '.*short.txt' has \d+ tokens, fewer than one window "
                                    r"of 2048; lower eval.perplexity.seq_len or use a longer eval.perplexity.dataset "
                                    r"\(checked before quantizing, as the eval stage would fail\)$", msg), msg
    assert not (tmp_path / "a" / "ev").exists()
    monkeypatch.setattr(source, "load_model", load)
    assert cli.main(["run", str(recipe), "--out", str(tmp_path / "a"), "--no-eval"]) == 0  # no eval: no check
    from tests.conftest import eval_main

    assert eval_main([str(recipe), "--out", str(tmp_path / "a"), "--no-vllm"]) == 2
    assert "fewer than one window of 2048; lower eval.perplexity.seq_len" in capsys.readouterr().err


def test_missing_eval_text_refused_before_weights(tiny_llama, tmp_path, monkeypatch, capsys):
    from quantize.source import load as source

    monkeypatch.setattr(source, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    recipe = tiny_recipe(tmp_path, tiny_llama, name="ev", method="rtn",
                         eval=dict(perplexity=dict(dataset=str(tmp_path / "nope.txt")), vllm=dict(enabled=False)))
    rc, msg = _cli(capsys, "run", recipe, "--out", tmp_path / "a")
    assert rc == 2 and msg == (f"error: eval.perplexity.dataset '{tmp_path / 'nope.txt'}': no such file; use "
                               f"wikitext2, c4 (hub) or the path of a local .txt file")
    assert not (tmp_path / "a" / "ev").exists()


def test_absurd_sample_count_is_named_by_the_text_not_the_disk(tiny_llama, tmp_path, monkeypatch, capsys):
    """n_samples 1e9 would also need petabytes of checkpoint: the count against the text is the cause to name."""
    from quantize.source import load as source

    monkeypatch.setattr(source, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    recipe = tiny_recipe(tmp_path, tiny_llama, name="ns", calibration=dict(dataset="groups-merged",
                                                                           n_samples=1_000_000_000, seq_len=64))
    rc, msg = _cli(capsys, "run", recipe, "--out", tmp_path / "a", "--no-eval")
    assert rc == 2 and re_match(r"error: calibration text has \d+ tokens but n_samples x seq_len = 1000000000 x 64 "
                                r"= 64000000000; lower calibration.n_samples", msg), msg


def test_cache_directory_that_is_a_file_is_named(tiny_llama, tmp_path, monkeypatch, capsys):
    from quantize.source import gguf

    monkeypatch.setattr(gguf, "_convert_gguf", lambda *a: pytest.fail("converted into a cache that is a file"))
    f = _gguf(tmp_path / "m.gguf", "llama")
    blocker = tmp_path / "cache-file"
    blocker.write_text("not a directory")
    recipe = tiny_recipe(tmp_path, f, name="gg", method="rtn")
    for cache in (blocker, blocker / "below"):
        monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(cache))
        rc, msg = _cli(capsys, "preflight", recipe, "--out", tmp_path / "a")
        assert rc == 2 and msg == (f"error: the cache directory {cache} (QUANTIZE_CACHE_DIR) cannot hold the GGUF "
                                   f"conversion: {blocker} is a file, not a directory; move that file aside, or set "
                                   f"QUANTIZE_CACHE_DIR to a directory you can write")
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("name,content,why", [
    ("config.json", "{bad", "is not valid JSON (Expecting property name"),
    ("manifest.json", "{bad", "is not valid JSON (Expecting property name"),
    ("manifest.json", "[1]", "holds a JSON list, not an object"),
])
def test_invalid_artifact_json_names_the_file(previous, tmp_path, capsys, name, content, why):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(previous / "keep", art)
    if name == "config.json":
        (art / "manifest.json").unlink()  # another tool's directory: nothing verifies config.json first
    (art / name).write_text(content)
    rc, msg = _cli(capsys, "eval", "--artifact", art, "--base", previous / "keep", "--no-vllm")
    assert rc == 2 and msg.startswith(f"error: {art / name} {why}") and msg.endswith(
        "restore that file, or re-create the artifact with make quantize"), msg


def re_match(pattern: str, text: str) -> bool:
    import re

    return re.match(pattern, text) is not None


@pytest.mark.parametrize("gpus", ["abc", "0", "-2"])
def test_make_quantize_refuses_a_gpu_count_that_is_not_a_positive_number(gpus):
    """`make quantize GPUS=x` fails before torchrun (whose own refusal is a traceback) with what to change."""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "quantize", f"GPUS={gpus}"],
                       cwd=root, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert f"error: GPUS={gpus}: give the number of processes" in p.stderr
    assert "Traceback" not in p.stderr


def test_converted_gguf_skips_its_header(tiny_llama, tmp_path, monkeypatch):
    """Reading the metadata parses the whole vocabulary (seconds for SmolLM2): a file already converted, unchanged
    since, is taken from the cache without it; a changed file is read again."""
    import shutil

    from quantize.source import gguf, load as source

    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "_convert_gguf",
                        lambda gguf, into: [shutil.copy(p, into / p.name) for p in tiny_llama.iterdir()])
    f = _gguf(tmp_path / "m.gguf", "llama")
    reads = []
    parse = gguf.gguf_architecture
    monkeypatch.setattr(gguf, "gguf_architecture", lambda *a: reads.append(a) or parse(*a))
    first = source.resolve(str(f)).path
    assert len(reads) == 1
    assert source.resolve(str(f)).path == first and len(reads) == 1
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # touched: maybe another file now
    assert source.resolve(str(f)).path == first and len(reads) == 2
    assert source.resolve(str(f)).path == first and len(reads) == 2  # same bytes: the cache took the new stamp


def test_converted_gguf_records_its_license(tiny_llama, tmp_path, monkeypatch):
    """The model card's license line comes from the conversion's source.json, not from parsing the GGUF file again
    at every export (seconds for SmolLM2); a cache made before the record holds it gets it once."""
    import shutil

    from quantize.export import modelcard
    from quantize.source import gguf, load as source

    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "_convert_gguf",
                        lambda gguf, into: [shutil.copy(p, into / p.name) for p in tiny_llama.iterdir()])
    f = _gguf(tmp_path / "m.gguf", "llama", {"general.license": "apache-2.0"})
    cached = source.resolve(str(f)).path
    assert json.loads((cached / "source.json").read_text())["license"] == "apache-2.0"
    monkeypatch.setattr(modelcard, "gguf_license", lambda g: pytest.fail("the GGUF was parsed again"))
    assert modelcard.source_license(cached) == "apache-2.0"

    record = json.loads((cached / "source.json").read_text())
    del record["license"]
    (cached / "source.json").write_text(json.dumps(record))  # a cache from before the record
    monkeypatch.undo()
    monkeypatch.setenv("QUANTIZE_CACHE_DIR", str(tmp_path / "cache"))
    assert source.resolve(str(f)).path == cached
    assert json.loads((cached / "source.json").read_text())["license"] == "apache-2.0"


@pytest.mark.parametrize("setting", ["gptq.kernel", "awq.clip_kernel", "awq.search_kernel"])
def test_triton_kernel_where_it_cannot_run_is_refused_before_weights(tiny_llama, tmp_path, monkeypatch, capsys,
                                                                     setting):
    """A recipe that names the Triton kernel on a device without it is told which setting to change in pre-flight,
    not at the first decoder layer."""
    from quantize.source import load as source

    if torch.cuda.is_available():
        pytest.skip("Triton runs here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(source, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    group, key = setting.split(".")
    recipe = tiny_recipe(tmp_path, tiny_llama, name="kern", device="cpu", advanced={group: {key: "triton"}})
    rc, msg = _cli(capsys, "run", recipe, "--out", tmp_path / "a", "--no-eval")
    assert rc == 2 and f"advanced.{setting} triton was asked for but cannot run" in msg, msg
    assert not (tmp_path / "a" / "kern").exists()
