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
                          eval=dict(perplexity=dict(seq_len=512, max_windows=3), max_ppl_delta_pct=60.0))
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
        "method": True, "not_degenerate": True, "agreement": True}
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
