"""Eval stage on tiny models: deterministic perplexity, gates, report + manifest hash, vLLM smoke pass/fail."""

import json

import pytest
import torch

from tests.conftest import eval_main
from eval.perplexity import Protocol, perplexity, windows
from quantize.manifest import report_hash_ok
from quantize import runner
from tests.conftest import write_recipe


@pytest.fixture(scope="module")
def artifact(tiny_eval_artifact):
    return tiny_eval_artifact


def test_perplexity_same_twice(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    text = "\n\n".join(["The tower is 324 metres tall, about the same height as an 81-storey building."] * 40)
    wins = windows(tok, text, Protocol(seq_len=64, max_windows=5))
    assert wins.shape == (5, 64)
    a, b = perplexity(model, wins), perplexity(model, wins)
    assert a["ppl"] == b["ppl"] and a["tokens"] == 5 * 63 and 1 < a["ppl"] < 10_000


@pytest.fixture(scope="module")
def smollm2_rtn(tmp_path_factory):
    """The real small model (SmolLM2-135M), round-to-nearest g64: seconds to make, and its perplexity means
    something (random-init tiny models are near-uniform, so damaging them barely moves perplexity)."""
    tmp = tmp_path_factory.mktemp("smol")
    recipe = write_recipe(tmp / "smol-rtn.yaml", base="smollm2-rtn-g64", name="smol-rtn",
                          eval=dict(perplexity=dict(seq_len=512, max_windows=3), max_ppl_delta_pct=60.0,
                                    lm_eval=dict(tasks=[])))
    return runner.run(recipe, out_root=tmp / "a"), recipe


def test_gate_fails_with_numbers(smollm2_rtn, capsys, tmp_path):
    """A damaged artifact (random codes in four layers) raises perplexity: gate fails, exit 3, numbers printed."""
    import shutil

    from safetensors.torch import load_file, save_file

    out, recipe = smollm2_rtn
    assert eval_main([str(recipe), "--artifact", str(out), "--no-vllm"]) == 0
    ok = json.loads((out / "report.json").read_text())
    assert ok["passed"] and 0 < ok["perplexity"]["delta_pct"] < 60 and report_hash_ok(out)  # RTN g64: about +35%
    md = (out / "report.md").read_text()
    assert "FP16 (base)" in md and "quantized (decoded from the artifact)" in md
    bad = tmp_path / "damaged"
    shutil.copytree(out, bad)
    t = load_file(str(bad / "model.safetensors"))
    for i in range(2, 6):
        name = f"model.layers.{i}.mlp.down_proj.qweight"
        t[name] = torch.randint(-2**31, 2**31 - 1, t[name].shape, dtype=torch.int32,
                                generator=torch.Generator().manual_seed(i))
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    # tampered: the manifest no longer verifies, so eval refuses it and names the file
    assert eval_main([str(recipe), "--artifact", str(bad), "--no-vllm"]) == 2
    assert "model.safetensors (sha256 differs from the manifest)" in capsys.readouterr().err
    # a badly quantized but intact artifact: re-hash it into its manifest, then the gate must catch it
    from quantize.files import sha256_file

    m = json.loads((bad / "manifest.json").read_text())
    m["files"]["model.safetensors"]["sha256"] = sha256_file(bad / "model.safetensors")
    m.pop("report", None)
    for name in ("report.json", "report.md"):  # an artifact is a closed set: unlisted files are refused
        (bad / name).unlink()
    (bad / "manifest.json").write_text(json.dumps(m))
    code = eval_main([str(recipe), "--artifact", str(bad), "--no-vllm"])
    captured = capsys.readouterr()
    assert code == 3 and "> eval.max_ppl_delta_pct 60.0%" in captured.err
    assert "perplexity FP16" in captured.out
    rep = json.loads((bad / "report.json").read_text())
    assert rep["passed"] is False and rep["perplexity"]["delta_pct"] > 60
    assert rep["perplexity"]["fp16"]["ppl"] == ok["perplexity"]["fp16"]["ppl"]  # same protocol, same windows
    assert "FAILED" in (bad / "report.md").read_text()


def _rehash(art) -> None:
    """A changed artifact made whole again: its manifest lists the new weights' sha256, no report."""
    from quantize.files import sha256_file

    m = json.loads((art / "manifest.json").read_text())
    m["files"]["model.safetensors"]["sha256"] = sha256_file(art / "model.safetensors")
    m.pop("report", None)
    for name in ("report.json", "report.md"):
        (art / name).unlink(missing_ok=True)
    (art / "manifest.json").write_text(json.dumps(m))


DAMAGED = "model.layers.0.mlp.down_proj.scales"


def test_one_damaged_linear_fails_the_kl_and_top1_gates(smollm2_rtn, capsys, tmp_path, monkeypatch):
    """One linear's scales doubled: KL and top-1 against the reference move past their default gates (exit 3,
    each gate named). Measured with 3 x 512 tokens (2026-12-02): healthy KL 0.31, top-1 0.665, perplexity
    +36 %; damaged KL 0.66, top-1 0.53, perplexity +87 % (29.52 -> 55.18). The damaged eval reads the reference
    from the cache: no reference forward."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eval import refcache, report
    from quantize.recipe import MAX_KL, MIN_TOP1

    out, recipe = smollm2_rtn
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "cache")
    assert eval_main([str(recipe), "--artifact", str(out), "--no-vllm"]) == 0
    ok = json.loads((out / "report.json").read_text())["distribution"]
    assert ok["kl_mean"] < MAX_KL and ok["top1"] > MIN_TOP1 and ok["k"] == 64 and ok["tokens"] == 3 * 511
    bad = tmp_path / "damaged"
    shutil.copytree(out, bad)
    t = load_file(str(bad / "model.safetensors"))
    t[DAMAGED] = t[DAMAGED] * 2
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _rehash(bad)
    scored = []
    real = report.perplexity
    monkeypatch.setattr(report, "perplexity", lambda m, w, b=1, label="", **kw: scored.append(label) or
                        real(m, w, b, label, **kw))
    capsys.readouterr()
    assert eval_main([str(recipe), "--artifact", str(bad), "--no-vllm"]) == 3
    err = capsys.readouterr().err
    assert scored == ["quantized"]  # the reference's distributions came from the cache
    rep = json.loads((bad / "report.json").read_text())
    d = rep["distribution"]
    assert d["kl_mean"] > MAX_KL and d["top1"] < MIN_TOP1
    assert f"> eval.max_kl {MAX_KL}" in err and f"< eval.min_top1 {MIN_TOP1}" in err
    assert d["kl_mean"] > 1.5 * ok["kl_mean"] and rep["perplexity"]["delta_pct"] > 60  # perplexity moved too
    md = (bad / "report.md").read_text()
    assert "KL mean" in md and "Worst windows" in md


@pytest.mark.vllm
def test_smoke_passes_then_corrupted_artifact_fails(artifact, capsys, tmp_path):
    import shutil

    from eval.serve import int4_kernel_missing

    if int4_kernel_missing():
        pytest.skip(int4_kernel_missing())
    out, recipe = artifact
    assert eval_main([str(recipe), "--artifact", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    s = rep["vllm_smoke"]
    assert s["passed"] and s["method"] == "awq" and s["served_name"] == "tiny-eval" and s["checks"] == {
        "loaded": True, "models_lists_served_name": True, "answers": True, "wrong_name_404": True,
        "method": True, "not_degenerate": True, "agreement": True, "decodes_as_ours": True}
    assert s["decode_agreement"] >= 0.75  # vLLM's CPU kernel computes what our own decoding computes
    assert "'tiny-eval'" in s["wrong_name"] and "404" in s["wrong_name"]
    assert any("CPUWNA16" in k for k in s["kernels"]) and s["tokens_per_s"] > 0
    assert rep["perplexity"]["protocol"]["windows"] == 4
    # corrupt: truncate the weights file -> vLLM cannot load it -> clear message, non-zero exit
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    from pipeline.stages import write_report  # noqa: F401  (report goes into the bad copy)
    from eval.smoke import smoke
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = json.loads((out / "manifest.json").read_text())["model"]["spec"]
    res = smoke(bad, lambda: AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base),
                max_tokens=4)
    assert res["passed"] is False and res["checks"]["loaded"] is False
    assert "vLLM's server exited" in res["errors"][0]
