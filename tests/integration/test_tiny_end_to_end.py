"""Tiny random-init models (built from configs, no download) quantized end to end on the CPU."""

import json

import pytest
import torch
from safetensors import safe_open

from eval.artifact import dequantized_state_dict, load_dequantized
from quantize import runner
from quantize.export import write as export
from quantize.files import sha256_file
from quantize.source.arch import UnsupportedArchitecture
from quantize.formats.awq_gemm import AWQ_ORDER
from quantize.formats.packing import unpack_int32
from tests.conftest import KEPT_16BIT, heldout_ids, kl_divergence as _kl, build_tiny_model, tiny_recipe


@pytest.fixture(scope="module")
def llama_artifact(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama-run")
    return runner.run(tiny_recipe(tmp, tiny_llama), out_root=tmp / "artifacts")


def test_artifact_layout(llama_artifact, tiny_llama):
    out = llama_artifact
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                          "version": "gemm", "modules_to_not_convert": ["lm_head"]}
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        keys = set(st.keys())
        q = "model.layers.0.self_attn.q_proj"
        assert {f"{q}.qweight", f"{q}.qzeros", f"{q}.scales"} <= keys and f"{q}.weight" not in keys
        assert st.get_tensor(f"{q}.qweight").shape == (256, 256 // 8)
        assert st.get_tensor(f"{q}.qzeros").shape == (256 // 64, 256 // 8)
        assert st.get_tensor(f"{q}.scales").dtype == torch.float16
        assert st.get_tensor("model.layers.1.mlp.down_proj.qweight").shape == (512, 256 // 8)
        assert st.get_tensor("lm_head.weight").dtype == torch.float16  # not converted
    # tokenizer and generation config copied byte for byte
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (tiny_llama / f).read_bytes()
    assert (out / "recipe.yaml").is_file()


def test_manifest_hashes_every_file(llama_artifact):
    m = json.loads((llama_artifact / "manifest.json").read_text())
    files = {p.name for p in llama_artifact.iterdir() if p.name != "manifest.json"}
    assert set(m["files"]) == files
    for name, rec in m["files"].items():
        assert sha256_file(llama_artifact / name) == rec["sha256"]
    assert m["calibration"]["source"].endswith("groups-merged.txt") and len(m["calibration"]["sha256"]) == 64
    assert {"preflight", "load", "calibrate", "quantize"} <= set(m["timings_s"])
    parts = m["stage_parts_s"]["preflight"]  # the parts the log's `stage preflight:` line shows
    assert {"config", "checkpoint", "plan", "device"} <= set(parts)
    assert 0 < sum(parts.values()) <= m["timings_s"]["preflight"] + 0.01
    assert m["versions"]["torch"] and "commit" in m["git"]
    assert m["device"] == "cpu" and m["cuda_allocator"] is None  # CUDA runs record their allocator settings
    assert m["quantized_modules"] == 14


def test_awq_search_never_worse_than_rtn(llama_artifact):
    m = json.loads((llama_artifact / "manifest.json").read_text())
    for layer in m["awq_stats"].values():
        assert set(layer["seconds"]) == {"scale_search", "clip", "quantize"}
        groups = [g for name, g in layer.items() if name != "seconds"]
        assert groups
        for g in groups:
            assert g["loss"] <= g["loss_rtn"]


def test_awq_artifact_closer_to_source_than_rtn(llama_artifact, tiny_llama, tmp_path):
    """Decoded from its packed tensors, the AWQ artifact is closer (KL) to the source than round-to-nearest."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    rtn = runner.run(tiny_recipe(tmp_path, tiny_llama, name="tiny-rtn-kl", method="rtn"), out_root=tmp_path / "a")
    ids = heldout_ids(tiny_llama)
    kl_awq, kl_rtn = _kl(ref, load_dequantized(llama_artifact), ids), _kl(ref, load_dequantized(rtn), ids)
    assert kl_awq < kl_rtn, (kl_awq, kl_rtn)
    assert kl_awq < 0.5  # 4-bit moves the output, but not to noise


def test_reproducible(llama_artifact, tiny_llama, tmp_path):
    again = runner.run(tiny_recipe(tmp_path, tiny_llama), out_root=tmp_path / "artifacts")
    a = json.loads((llama_artifact / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    b = json.loads((again / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    assert a == b


def test_existing_output_refused_and_untouched(llama_artifact, tiny_llama, tmp_path):
    recipe = tiny_recipe(tmp_path, tiny_llama)
    before = (llama_artifact / "manifest.json").read_bytes()
    with pytest.raises(export.OutputExistsError, match="--force"):
        runner.run(recipe, out_root=llama_artifact.parent)
    assert (llama_artifact / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("during_pass", [False, True], ids=["at-export", "during-the-pass"])
def test_failure_during_export_leaves_nothing(tiny_llama, tmp_path, monkeypatch, during_pass):
    """A shard write that fails, at export or while the pass writes layers (as on CUDA), removes everything."""
    def boom(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(export, "save_file", boom)
    monkeypatch.setattr(runner, "WRITE_DURING_PASS", {"cpu"} if during_pass else set())
    with pytest.raises(OSError, match="No space"):
        # no resume checkpoint: on a slow box one would be saved (and kept, by design) after a layer
        runner.run(tiny_recipe(tmp_path, tiny_llama, checkpoint_every_s=None), out_root=tmp_path / "artifacts")
    assert [p.name for p in (tmp_path / "artifacts").iterdir()] == []  # no temp dir, no lock file


def test_sharded_output(tiny_qwen2, tmp_path):
    out = runner.run(tiny_recipe(tmp_path, tiny_qwen2, name="tiny-shard", max_shard_size="300KB"),
                     out_root=tmp_path / "artifacts")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    state, _ = dequantized_state_dict(out)
    assert "model.layers.0.self_attn.q_proj.bias" in state  # Qwen2 q/k/v biases kept


def test_rtn_method(tiny_llama, tmp_path):
    out = runner.run(tiny_recipe(tmp_path, tiny_llama, name="tiny-rtn", method="rtn"), out_root=tmp_path / "a")
    m = json.loads((out / "manifest.json").read_text())
    assert m["calibration"] is None and m["quantized_modules"] == 14


def test_unknown_architecture(tmp_path, tiny_llama):
    import shutil

    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        runner.run(tiny_recipe(tmp_path, d), out_root=tmp_path / "a")


def test_indivisible_group_is_named(tmp_path):
    d = build_tiny_model(tmp_path / "m96", "llama", hidden=192, intermediate=384, heads=3, kv_heads=1)
    with pytest.raises(runner.PreflightError, match=r"in_features 192 is not divisible by q_group_size 128.*\[32, 64\]"):
        runner.run(tiny_recipe(tmp_path, d, q_group_size=128), out_root=tmp_path / "a")


def test_indivisible_search_group_is_named(tmp_path):
    """awq.search_group_size must divide what q_group_size must; on_indivisible does not skip for it."""
    d = build_tiny_model(tmp_path / "m96", "llama", hidden=192, intermediate=384, heads=3, kv_heads=1)
    recipe = tiny_recipe(tmp_path, d, q_group_size=32, on_indivisible="skip",
                         awq=dict(n_grid=10, clip_grid=10, search_group_size=128))
    with pytest.raises(runner.PreflightError, match=r"in_features 192 is not divisible by awq.search_group_size "
                                                    r"128; use 32 or 64, or null"):
        runner.run(recipe, out_root=tmp_path / "a")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_partial_fused_skip_refused(tmp_path, tiny_llama):
    with pytest.raises(runner.PreflightError, match="must skip all of them or none"):
        runner.run(tiny_recipe(tmp_path, tiny_llama, modules_to_not_convert=["lm_head", "layers.0.self_attn.q_proj"]),
                   out_root=tmp_path / "a")


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_other_architectures(kind, tmp_path):
    d = build_tiny_model(tmp_path / kind, kind, layers=1)
    out = runner.run(tiny_recipe(tmp_path, d, name=f"tiny-{kind}"), out_root=tmp_path / "a")
    assert load_dequantized(out) is not None


def test_symmetric_writes_zero_8(tmp_path, tiny_llama):
    out = runner.run(tiny_recipe(tmp_path, tiny_llama, name="tiny-sym", zero_point=False), out_root=tmp_path / "a")
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        z = unpack_int32(st.get_tensor("model.layers.0.mlp.up_proj.qzeros"), 4, AWQ_ORDER)
    assert (z == 8).all()


def test_sharded_source_checkpoint(tiny_llama, tmp_path):
    """A source checkpoint split into several safetensors shards loads and quantizes like a single file."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = tmp_path / "sharded"
    shutil.copytree(tiny_llama, src)
    (src / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(src, max_shard_size="400KB")
    assert len(list(src.glob("model-*.safetensors"))) > 1
    a = runner.run(tiny_recipe(tmp_path, src, name="from-shards", method="rtn"), out_root=tmp_path / "a")
    b = runner.run(tiny_recipe(tmp_path, tiny_llama, name="from-single", method="rtn"), out_root=tmp_path / "a")
    sa, _ = dequantized_state_dict(a)
    sb, _ = dequantized_state_dict(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert (a / "model.safetensors").stat().st_mode & 0o777 == 0o644 & ~umask  # not safetensors' 0600


def test_on_indivisible_skip_keeps_layers_16bit(tmp_path):
    """hidden 192 is not divisible by 128: with on_indivisible: skip those linears stay 16-bit, and say so."""
    d = build_tiny_model(tmp_path / "m192", "llama", hidden=192, intermediate=384, heads=3, kv_heads=1, layers=1)
    out = runner.run(tiny_recipe(tmp_path, d, name="skip", method="rtn", q_group_size=128, on_indivisible="skip"),
                     out_root=tmp_path / "a")
    m = json.loads((out / "manifest.json").read_text())
    skipped = {k for k, v in m["skipped_linears"].items() if "on_indivisible" in v}
    assert skipped == {f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert m["quantized_modules"] == 1  # down_proj: in 384 = 3 x 128
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(cfg["modules_to_not_convert"]) == {"lm_head", *skipped}
    state, _ = dequantized_state_dict(out)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (192, 192)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_modules_to_not_convert_is_written_16bit_and_named(fmt, kept_16bit_artifacts, tiny_llama):
    """A linear the recipe keeps out is written as its unchanged 16-bit weight and named where the format's
    reader looks for it: AWQ's modules_to_not_convert, compressed-tensors' ignore (which lists lm_head and every
    16-bit linear, or vLLM expects packed tensors for it). GPTQ has no such list: vLLM treats a linear with no
    integer tensors in the checkpoint as unquantized (test_vllm_load checks that it loads)."""
    out = kept_16bit_artifacts[fmt]
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    if fmt == "awq":
        assert qcfg["modules_to_not_convert"] == ["lm_head", KEPT_16BIT]
    if fmt == "compressed-tensors":
        assert qcfg["ignore"] == ["lm_head", KEPT_16BIT]
    with safe_open(str(out / "model.safetensors"), "pt") as st, \
            safe_open(str(tiny_llama / "model.safetensors"), "pt") as src:
        assert [k for k in st.keys() if k.startswith(f"{KEPT_16BIT}.")] == [f"{KEPT_16BIT}.weight"]
        kept = st.get_tensor(f"{KEPT_16BIT}.weight")
        assert kept.dtype == torch.float16 and torch.equal(kept, src.get_tensor(f"{KEPT_16BIT}.weight"))
        assert "model.layers.1.mlp.down_proj.weight" not in st.keys()  # the same linear of layer 1 is converted


def test_compressed_tensors_ignore_lists_indivisible_skips(tmp_path):
    """Linears kept 16-bit for an indivisible shape are in `ignore` next to the recipe's own."""
    d = build_tiny_model(tmp_path / "m192", "llama", hidden=192, intermediate=384, heads=3, kv_heads=1, layers=2)
    out = runner.run(tiny_recipe(tmp_path, d, name="skip-ct", method="rtn", q_group_size=128, on_indivisible="skip",
                                 format="compressed-tensors", modules_to_not_convert=["lm_head", KEPT_16BIT]),
                     out_root=tmp_path / "a")
    m = json.loads((out / "manifest.json").read_text())
    assert m["quantized_modules"] == 1  # layer 1's down_proj: in 384 = 3 x 128; the rest stay 16-bit
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore[0] == "lm_head" and set(ignore[1:]) == set(m["skipped_linears"]) and len(ignore) == 14
    assert KEPT_16BIT in ignore and "model.layers.1.mlp.down_proj" not in ignore


def test_manifest_verifies_and_tampering_is_refused(llama_artifact, tmp_path):
    import shutil

    from quantize.manifest import ArtifactError, verify as verify_manifest

    assert verify_manifest(llama_artifact) is True
    bad = tmp_path / "bad"
    shutil.copytree(llama_artifact, bad)
    with open(bad / "config.json", "a") as f:
        f.write(" ")
    (bad / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match=r"config.json \(sha256 differs.*tokenizer.json \(missing\)"):
        verify_manifest(bad)
    (bad / "manifest.json").unlink()
    assert verify_manifest(bad) is False  # a directory we did not make: nothing to verify against


def test_gemma3_awq_closer_to_source_than_rtn(tmp_path):
    """Gemma's norms scale by (1 + weight): AWQ's scales folded into them must keep the model's function, and
    the sliding-window and global layers calibrate with their own masks and positions."""
    from transformers import AutoModelForCausalLM

    d = build_tiny_model(tmp_path / "g", "gemma3", layers=2)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ids = heldout_ids(d)
    outs = {m: runner.run(tiny_recipe(tmp_path, d, name=f"tiny-g3-{m}", method=m, dtype="bfloat16"),
                          out_root=tmp_path / "a")
            for m in ("awq", "rtn")}
    kl = {m: _kl(ref, load_dequantized(o), ids) for m, o in outs.items()}
    assert kl["awq"] < kl["rtn"], kl
