"""Sharded export: the shards `ShardWriter` fills by huggingface_hub's rule, an index that maps every tensor, and
the tensors read back equal the way vLLM reads a checkpoint (the index's files, each opened with safetensors)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantize.export.write import ShardWriter

INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def write_sharded(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int) -> list[str]:
    """The tensors in name order through one ShardWriter (the order a single group is written in)."""
    writer = ShardWriter(out, max_bytes)
    writer.add({n: tensors[n] for n in sorted(tensors)})
    return writer.finish()


def test_groups_added_in_order_fill_shards_in_that_order(tmp_path):
    """Tensors added group by group (as `WeightStream` adds the pass's layers) fill the shards in the order added,
    not in name order; each full shard is written (and handed on) before `finish`."""
    written = []
    writer = ShardWriter(tmp_path, 250, on_written=lambda p: written.append(p.name))
    writer.add({"z.b": torch.ones(25), "z.a": torch.ones(25)})  # 100 bytes each
    writer.add({"a.a": torch.ones(25), "a.b": torch.ones(25)})  # a.a would pass 250: z.b z.a | a.a a.b
    writer.futures[0].result()  # the full shard has been written
    assert written == [".shard-00001.safetensors"]
    files = writer.finish()
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    index = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    assert index == {"a.a": files[1], "a.b": files[1], "z.a": files[0], "z.b": files[0]}  # not name order
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)


def tiny_state_dict() -> dict[str, torch.Tensor]:
    """A 2-layer Llama from its config in float16 (largest tensor 256 KiB) plus an int32 packed-like tensor."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["model.layers.0.mlp.down_proj.qweight"] = torch.randint(-2**31, 2**31 - 1, (512, 32), dtype=torch.int32)
    return sd


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def load_like_vllm(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The index's shard files, every tensor of each -> ({name: tensor}, {name: file it was found in})."""
    index = json.loads((out / INDEX).read_text())
    got, where = {}, {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / fname), "pt") as f:
            for name in f.keys():
                assert name not in got, f"{name} is in two shards"
                got[name], where[name] = f.get_tensor(name), fname
    return got, where


def test_tiny_model_in_several_shards_reads_back_equal(tmp_path):
    sd = tiny_state_dict()
    max_bytes = 600_000
    files = write_sharded(dict(sd), tmp_path, max_bytes)

    shards = files[:-1]
    assert files[-1] == INDEX and len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)

    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(shards)
    assert list(index["weight_map"]) == sorted(sd)
    assert index["metadata"] == {"total_size": sum(nbytes(t) for t in sd.values())}

    got, where = load_like_vllm(tmp_path)
    assert where == index["weight_map"]
    for name, t in sd.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    # no tensor is over the limit, so the shards are runs of the sorted names, each filled until the next
    # tensor would pass the limit (huggingface_hub's layout for tensors in name order)
    names = sorted(sd)
    assert [SHARD.fullmatch(where[n]).group(1) for n in names] == sorted(SHARD.fullmatch(where[n]).group(1)
                                                                         for n in names)
    runs = [[n for n in names if where[n] == s] for s in shards]
    for run, nxt in zip(runs, runs[1:]):
        assert sum(nbytes(sd[n]) for n in run) <= max_bytes < sum(nbytes(sd[n]) for n in run) + nbytes(sd[nxt[0]])


def test_under_the_limit_one_file_and_no_index(tmp_path):
    sd = tiny_state_dict()
    assert write_sharded(dict(sd), tmp_path, 10**9) == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(sd)


def test_a_tensor_over_the_limit_gets_a_shard_of_its_own(tmp_path):
    sd = {"a": torch.ones(25), "b": torch.arange(250, dtype=torch.float32), "c": torch.zeros(25), "d": torch.ones(25)}
    files = write_sharded(dict(sd), tmp_path, 250)  # b is 1000 bytes, the others 100
    index = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    assert [n for n in index if index[n] == index["b"]] == ["b"]
    assert set(index.values()) == set(files[:-1])
    got, _ = load_like_vllm(tmp_path)
    assert all(torch.equal(got[n], sd[n]) for n in sd)


def test_views_are_sized_and_written_as_their_own_bytes(tmp_path):
    buf = torch.arange(1000, dtype=torch.float32)  # 4000 bytes
    sd = {"x": buf[:100], "y": buf[100:300], "z": torch.ones(50)}  # 400, 800, 200 bytes
    write_sharded(sd, tmp_path, 1000)
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 1400
    assert index["weight_map"] == {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors",
                                   "z": "model-00002-of-00002.safetensors"}
    got, _ = load_like_vllm(tmp_path)
    assert all(torch.equal(got[n], sd[n]) for n in sd)


@pytest.mark.parametrize("max_bytes", [300_000, 600_000])
def test_the_layout_does_not_depend_on_the_input_order(tmp_path, max_bytes):
    sd = tiny_state_dict()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert write_sharded(dict(sd), a, max_bytes) == write_sharded(dict(reversed(list(sd.items()))), b, max_bytes)
    assert (a / INDEX).read_bytes() == (b / INDEX).read_bytes()


def test_non_finite_tensors_bound_for_an_artifact_are_named_together():
    """Export checks the unconverted tensors in a thread (`nonfinite`) and the packed ones itself; one error names
    every bad tensor of both, in name order, and a finite artifact passes."""
    from quantize.export.write import NonFiniteTensorError, check_finite, nonfinite

    good = {"a.scales": torch.ones(4, dtype=torch.float16), "a.qweight": torch.zeros(4, dtype=torch.int32)}
    embed = torch.ones(8, 2)
    embed[3, 1] = float("nan")
    found = nonfinite({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(2)})
    assert list(found) == ["model.embed_tokens.weight"]
    check_finite(good, "the checkpoint", {})
    bad_scales = {**good, "b.scales": torch.tensor([1.0, float("inf")], dtype=torch.float16)}
    with pytest.raises(NonFiniteTensorError) as e:
        check_finite(bad_scales, "the checkpoint", found)
    msg = str(e.value)
    assert msg.startswith("2 tensor(s)") and msg.index("b.scales (1 of 2") < msg.index("model.embed_tokens.weight (1 of 16")
