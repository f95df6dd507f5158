"""The eval stage's device logic on the CPU: where it computes and in which dtype, the verified reference cache,
the NaN gate, the finite check before an artifact is written, and the dtype vLLM is asked for."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval import gates, refcache, report
from tests.conftest import eval_main
from eval.perplexity import Protocol, protocol_record, windows
from quantize import manifest, runner
from pipeline import stages
from pipeline.cli import main as quantize_main
from quantize.files import sha256_file
from quantize.recipe import EvalOptions
from quantize.records import Manifest
from tests.conftest import build_tiny_model, tiny_recipe


def _manifest(**over) -> Manifest:
    """A manifest record as a tiny run writes it (tests/golden/records), with `over` in place."""
    m = manifest.read(Path(__file__).resolve().parents[1] / "golden" / "records" / "records-awq")
    return m.model_copy(update=over)


def test_eval_device_follows_the_manifest(caplog):
    assert report.eval_device(_manifest(device="cpu")) == torch.device("cpu")
    assert report.eval_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert report.eval_device(_manifest(device="cuda")) == torch.device("cpu")
        assert "quantized on cuda but no CUDA device is visible" in caplog.text


def test_eval_dtype_cpu_float32_gpu_the_artifacts(tmp_path):
    cuda = torch.device("cuda")
    assert report.eval_dtype(torch.device("cpu"), "bfloat16") == torch.float32
    assert report.eval_dtype(cuda, "bfloat16") == torch.bfloat16
    assert report.eval_dtype(cuda, "float16") == torch.float16
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert report.served_dtype(tmp_path, None) == "bfloat16"  # another tool's artifact: its config
    ours = _manifest()
    ours = ours.model_copy(update={"recipe": ours.recipe.model_copy(update={"dtype": "float16"})})
    assert report.served_dtype(tmp_path, ours) == "float16"  # ours: the recipe


def test_cache_key_verified_not_trusted_by_name(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights-1")
    (model / "notes.md").write_text("not part of the key")
    root = tmp_path / "cache"
    proto = {"dataset": "wikitext2", "seq_len": 8, "text_sha256": "ab", "windows": 2}
    sha = refcache.model_sha256(model)
    key = refcache.make_key(sha, proto, torch.float32, torch.device("cpu"))
    result = {"ppl": 12.5, "nll_sum": 1.0, "tokens": 14, "per_window_nll": [0.1, 0.2], "seconds": 1.0}
    assert refcache.lookup(key, root) is None
    refcache.store(key, result, root)
    assert refcache.lookup(key, root)["ppl"] == 12.5
    (model / "notes.md").write_text("changed")  # not a model file
    assert refcache.model_sha256(model) == sha
    (model / "model.safetensors").write_bytes(b"weights-2")  # the weights changed: another key
    key2 = refcache.make_key(refcache.model_sha256(model), proto, torch.float32, torch.device("cpu"))
    assert key2 != key and refcache.lookup(key2, root) is None
    for other in ({**proto, "windows": 3}, proto):  # protocol / dtype: other keys
        k = refcache.make_key(sha, other, torch.bfloat16 if other is proto else torch.float32, torch.device("cpu"))
        assert refcache.lookup(k, root) is None
    # an entry copied under another key's file name is refused: the stored key must equal the asked one
    shutil.copy(refcache.entry_path(key, root), refcache.entry_path(key2, root))
    assert refcache.lookup(key2, root) is None
    refcache.entry_path(key, root).write_text("{not json")
    assert refcache.lookup(key, root) is None
    refcache.store(key, {**result, "ppl": math.nan}, root)  # a NaN reference is never cached
    assert refcache.lookup(key, root) is None


def test_model_hash_covers_every_piece(tmp_path, monkeypatch):
    monkeypatch.setattr(refcache, "CHUNK", 4)  # pieces of 4 bytes: a 10-byte file is 3 of them
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"0123456789")
    a = refcache.model_sha256(tmp_path)
    assert refcache.model_sha256(tmp_path) == a
    (tmp_path / "model.safetensors").write_bytes(b"0123456x89")  # the middle piece changed
    b = refcache.model_sha256(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"012345678")  # shorter: the last piece
    assert len({a, b, refcache.model_sha256(tmp_path)}) == 3


def test_nan_fails_every_gate():
    nan = {"protocol": {}, "fp16": {"ppl": 20.0}, "quantized": {"ppl": math.nan}, "delta": math.nan,
           "delta_pct": math.nan}
    for limits in ({"max_ppl_delta": None, "max_ppl_delta_pct": None}, {"max_ppl_delta": 1.0, "max_ppl_delta_pct": 5}):
        g = gates.check(nan, EvalOptions(**limits))
        assert not g["passed"] and "perplexity is not finite (quantized nan)" in g["failures"][0]
    inf_ref = {**nan, "fp16": {"ppl": math.inf}, "quantized": {"ppl": 20.0}}
    assert not gates.check(inf_ref, EvalOptions(max_ppl_delta_pct=None))["passed"]


@pytest.fixture(scope="module")
def evaluated(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evdev")
    recipe = tiny_recipe(tmp, tiny_llama, name="tiny-dev", eval=dict(
        perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=3), vllm=dict(enabled=False),
        max_ppl_delta_pct=50))
    return runner.run(recipe, out_root=tmp / "a"), recipe


def test_reference_scored_once_then_read_from_the_cache(evaluated, monkeypatch, tmp_path, capsys):
    out, recipe = evaluated
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path)
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    first = json.loads((out / "report.json").read_text())
    s = first["scored_on"]
    assert s["device"] == "cpu" and s["dtype"] == "float32" and s["reference_cache"]["hit"] is False
    assert s["host_rss_peak_bytes"] > 0
    assert "both models scored on cpu in float32" in (out / "report.md").read_text()
    assert "both models scored on cpu in float32" in (out / "README.md").read_text()

    def no_reference(*a, **k):
        raise AssertionError("the reference was loaded although its perplexity is cached")

    monkeypatch.setattr(report.source, "load_model", no_reference)
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["scored_on"]["reference_cache"]["hit"] is True
    assert again["perplexity"]["fp16"] == first["perplexity"]["fp16"]
    assert again["perplexity"]["quantized"]["ppl"] == first["perplexity"]["quantized"]["ppl"]
    assert "reference from the verified cache" in (out / "report.md").read_text()
    assert again["distribution"] == first["distribution"]  # KL and top-1 from the cached distributions


def test_an_entry_without_distributions_scores_the_reference_once_more(evaluated, monkeypatch, tmp_path):
    """A cache entry holding only the perplexity (as entries were first written): the next eval scores the
    reference once and rewrites the entry; every eval after that runs no reference forward."""
    out, recipe = evaluated
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path)
    loads = []
    real = report.source.load_model
    monkeypatch.setattr(report.source, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0 and len(loads) == 1
    (entry,) = tmp_path.glob("reference-ppl/*[0-9a-f].json")
    old = json.loads(entry.read_text())
    del old["distribution"]
    entry.write_text(json.dumps(old))
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0 and len(loads) == 2
    rep = json.loads((out / "report.json").read_text())
    assert rep["scored_on"]["reference_cache"]["rewritten"] and "distribution" in json.loads(entry.read_text())
    for _ in range(2):
        assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    assert len(loads) == 2


def test_nan_artifact_fails_eval_with_exit_3(evaluated, tmp_path, capsys):
    """NaN scales decode to NaN weights: perplexity NaN -> every gate fails, exit 3 (even with no delta gate)."""
    out, recipe = evaluated
    bad = tmp_path / "nan"
    shutil.copytree(out, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.scales"][0, 0] = float("nan")
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    m = json.loads((bad / "manifest.json").read_text())
    m["files"]["model.safetensors"]["sha256"] = sha256_file(bad / "model.safetensors")
    m.pop("report", None)  # a re-evaluated artifact: its old report goes with its hashes (a closed set)
    (bad / "manifest.json").write_text(json.dumps(m))
    for n in ("report.json", "report.md"):
        (bad / n).unlink(missing_ok=True)
    assert eval_main([str(recipe), "--artifact", str(bad)]) == 3
    assert "perplexity is not finite" in capsys.readouterr().err
    assert json.loads((bad / "report.json").read_text())["passed"] is False


@pytest.mark.parametrize("method,tensor", [("rtn", "model.embed_tokens.weight"), ("awq", "lm_head.weight")])
def test_non_finite_tensor_never_reaches_an_artifact(tmp_path, capsys, method, tensor):
    src = build_tiny_model(tmp_path / "m", "llama", tie=False)
    t = load_file(str(src / "model.safetensors"))
    t[tensor][3, :5] = float("nan")
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    recipe = tiny_recipe(tmp_path, src, name=f"nan-{method}", method=method, eval=dict(enabled=False))
    capsys.readouterr()  # the checkpoint's own build output
    assert quantize_main(["run", str(recipe), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{tensor} (5 of" in last and "nothing was written" in last
    assert "Traceback" not in err
    assert not (tmp_path / "a" / f"nan-{method}").exists()
    assert not [p for p in (tmp_path / "a").iterdir() if ".tmp-" in p.name]


def test_vllm_asked_for_the_artifacts_dtype(evaluated, monkeypatch, tmp_path):
    """The smoke stage asks vLLM for the recipe's dtype (a bfloat16-only model can pass), and a missing vLLM
    is a skip with its reason, which the registry then refuses."""
    from eval import smoke as smoke_mod

    out, recipe = evaluated
    art = tmp_path / "bf16"
    shutil.copytree(out, art)
    m = json.loads((art / "manifest.json").read_text())
    m["recipe"]["dtype"] = "bfloat16"
    m.pop("report", None)
    (art / "manifest.json").write_text(json.dumps(m))
    for n in ("report.json", "report.md"):
        (art / n).unlink(missing_ok=True)
    asked = {}

    class FakeServer:
        def __init__(self, model_dir, extra=None, **kw):
            asked.update(extra or {})

        def __enter__(self):
            raise smoke_mod.VllmError("stop here")

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(smoke_mod, "Server", FakeServer)
    monkeypatch.setattr(report, "vllm_unavailable", lambda: None)  # as on a host whose vLLM serves 4-bit
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path)
    # a random-init tiny model: its top-1 agreement says nothing, so only the smoke stage may fail the report
    eopts = EvalOptions(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2), max_kl=None,
                        min_top1=None)
    r = stages.evaluate(art, None, eopts)
    assert asked["dtype"] == "bfloat16" and r.vllm_smoke.dtype == "bfloat16" and not r.passed
    monkeypatch.setattr(report, "vllm_unavailable", lambda: "vllm not importable")
    r = stages.evaluate(art, None, eopts)
    assert r.vllm_smoke.to_json() == {"skipped": "vllm not importable", "endpoint": "/v1/chat/completions"}
    assert "vLLM smoke-load: skipped (vllm not importable)" in (art / "README.md").read_text()
    from pipeline import registry

    with pytest.raises(registry.RegistryError, match=r"vLLM never loaded it \(vllm not importable\)"):
        registry.check_artifact(art)


def test_windows_batched_score_as_one_by_one(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.perplexity import perplexity

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    wins = windows(tok, "\n\n".join(["Water boils at one hundred degrees at sea level."] * 60), Protocol(seq_len=64))
    one, four = perplexity(model, wins, 1), perplexity(model, wins, 4)
    assert one["tokens"] == four["tokens"] and abs(one["ppl"] - four["ppl"]) < 1e-4 * one["ppl"]
    assert len(four["per_window_nll"]) == wins.shape[0]
    assert protocol_record(Protocol(seq_len=64), "t", "s", wins)["windows"] == wins.shape[0]


def test_root_cause_keeps_the_pydantic_reason():
    from eval.vllm_run import root_cause

    log = "\n".join([
        "INFO 12-01 03:40:01 [config.py:1] Resolved architecture: LlamaForCausalLM",
        "Traceback (most recent call last):",
        '  File "x.py", line 3, in <module>',
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, The checkpoint's dtype is not supported [type=value_error, input_value=ArgsKwargs(("
        + "x" * 5000 + ")), input_type=ArgsKwargs]",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ])
    got = root_cause(log)
    assert "1 validation error for ModelConfig" in got and "Value error, The checkpoint's dtype" in got
    assert "errors.pydantic.dev" not in got and len(got) < 400  # the echoed arguments are cut


@pytest.mark.vllm
@pytest.mark.vllm_no_4bit
def test_vllm_refusal_names_its_reason(evaluated):
    """A real vLLM refusal (float32 for AWQ) reaches the user with vLLM's reason, not only its first line."""
    from eval.vllm_run import VllmError, run_vllm

    out, _ = evaluated
    with pytest.raises(VllmError) as e:
        run_vllm(out, [[1, 2, 3]], dtype="float32", timeout=300)
    assert "float32 is not supported for quantization method awq" in str(e.value)


def test_smoke_skips_where_vllm_cannot_serve_4bit(monkeypatch):
    from eval import smoke as smoke_mod

    monkeypatch.setattr(smoke_mod, "int4_kernel_missing", lambda: smoke_mod.INT4_MISSING)
    assert "AVX-512" in smoke_mod.vllm_unavailable()
    monkeypatch.setattr(smoke_mod, "int4_kernel_missing", lambda: None)
    assert smoke_mod.vllm_unavailable() is None
    monkeypatch.setattr(smoke_mod.importlib.util, "find_spec", lambda name: None)
    assert smoke_mod.vllm_unavailable() == "vllm not importable"


def test_eval_and_register_wait_for_the_outputs_lock(evaluated, capsys):
    """A run holding the output's lock (a --force re-run, say) keeps eval and register off the artifact."""
    from pipeline.cli import main as quantize_cli
    from quantize.lock import output_lock

    out, recipe = evaluated
    with output_lock(out):
        assert eval_main([str(recipe), "--artifact", str(out)]) == 2
        assert "is locked by another run" in capsys.readouterr().err
        assert quantize_cli(["register", "--artifact", str(out)]) == 2
        assert "is locked by another run" in capsys.readouterr().err


def test_register_refuses_a_report_of_other_files(evaluated, tmp_path, monkeypatch):
    """An eval that scored one artifact and wrote its report into a re-made one (the race a lock-free eval lost)
    cannot vouch for the new files: register refuses, naming the fix."""
    from pipeline.stages import write_report
    from pipeline import registry

    out, _ = evaluated
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(report, "vllm_unavailable", lambda: None)
    monkeypatch.setattr(report, "smoke", lambda *a, **k: {"passed": True, "checks": {}, "errors": []})
    r = stages.evaluate(out, None, EvalOptions(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2),
                                                max_ppl_delta_pct=None, max_kl=None, min_top1=None))
    registry.check_artifact(out)  # the report matches its files
    remade = tmp_path / "remade"
    shutil.copytree(out, remade)
    t = load_file(str(remade / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.scales"] *= 1.01  # another quantization of the same recipe
    save_file(t, str(remade / "model.safetensors"), metadata={"format": "pt"})
    m = json.loads((remade / "manifest.json").read_text())
    m["files"]["model.safetensors"]["sha256"] = sha256_file(remade / "model.safetensors")
    (remade / "manifest.json").write_text(json.dumps(m))
    write_report(remade, r)  # the old eval's report lands in the new artifact, hashed into its manifest
    with pytest.raises(registry.RegistryError, match="its report scored other files than the artifact holds now"):
        registry.check_artifact(remade)
