"""NaN/inf: half-precision overflow is cured by continuing in float32; damaged weights stop the run by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize import runner
from quantize.capture.loop import NumericalError
from pipeline.cli import main as cli_main
from tests.conftest import build_tiny_model, tiny_recipe


def _edit(model_dir, name, fn):
    path = model_dir / "model.safetensors"
    t = load_file(str(path))
    t[name] = fn(t[name])
    save_file(t, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_fp16_overflow_continues_in_float32(tmp_path, method):
    """Layer 1's MLP output exceeds fp16's 65504 (as Qwen's do): the pass upcasts and says so in the manifest."""
    d = build_tiny_model(tmp_path / "m", "llama", layers=3)
    _edit(d, "model.layers.0.mlp.down_proj.weight", lambda w: (w.float() * 3e4).clamp(-6e4, 6e4).half())
    over = dict(method="gptq", zero_point=False) if method == "gptq" else {}
    out = runner.run(tiny_recipe(tmp_path, d, name=f"ovf-{method}", compute_dtype="float16", **over),
                     out_root=tmp_path / "a")
    notes = json.loads((out / "manifest.json").read_text())["notes"]
    assert any("decoder layer 1" in n and "NaN/inf" in n and "continued in float32" in n for n in notes), notes
    t = load_file(str(out / "model.safetensors"))
    assert all(torch.isfinite(v.float()).all() for v in t.values() if v.is_floating_point())


def test_nan_weight_stops_naming_the_layer(tmp_path, capsys):
    d = build_tiny_model(tmp_path / "m", "llama", layers=2)
    _edit(d, "model.layers.1.self_attn.o_proj.weight", lambda w: w.index_put_((torch.tensor([3]),), torch.tensor(float("nan"), dtype=w.dtype)))
    recipe = tiny_recipe(tmp_path, d, name="nan")
    with pytest.raises(NumericalError, match=r"decoder layer 2: self_attn.o_proj.weight contain NaN/inf"):
        runner.run(recipe, out_root=tmp_path / "a")
    assert cli_main(["run", str(recipe), "--out", str(tmp_path / "b"), "--no-eval"]) == 2
    assert "decoder layer 2: self_attn.o_proj.weight" in capsys.readouterr().err
    assert not (tmp_path / "a" / "nan").exists() and not (tmp_path / "b" / "nan").exists()
