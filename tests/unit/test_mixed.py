"""What each format stores per weight of a converted linear, held to what pack writes; compressed-tensors config
groups per group size."""

from __future__ import annotations

import pytest
import torch

from quantize import formats
from quantize.recipe import Recipe

BASE = dict(name="x", model="m", method="awq", q_group_size=64, format="compressed-tensors")


# ---- bits per weight: one definition, the format's, held to what pack writes ----

@pytest.mark.parametrize("fmt", formats.NAMES)
@pytest.mark.parametrize("shape,group", [((192, 576), 64), ((576, 1536), 32), ((64, 256), 128), ((40, 96), 32)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_linear_bytes_are_the_bytes_pack_writes(fmt, shape, group, symmetric):
    f = formats.get(fmt)
    out_f, in_f = shape
    if out_f % f.pack_along_out:
        pytest.skip("the layout needs out_features divisible by 8")
    n = in_f // group
    zeros = torch.full((out_f, n), 8, dtype=torch.int32) if symmetric else torch.randint(0, 16, (out_f, n), dtype=torch.int32)
    packed = f.pack(torch.randint(0, 16, shape, dtype=torch.uint8), torch.rand(out_f, n).half(), zeros, 4, symmetric)
    written = sum(t.numel() * t.element_size() for t in packed.values())
    assert f.linear_bytes(out_f, in_f, group, 4, symmetric) == written
    exact = f.bits_per_weight(group, 4, symmetric, shape)
    assert exact == 8 * written / (out_f * in_f)
    per_linear = {"compressed-tensors": 128, "gptq": 32 * in_f, "awq": 0}[fmt]  # weight_shape; g_idx
    assert exact == pytest.approx(f.bits_per_weight(group, 4, symmetric) + per_linear / (out_f * in_f))


def test_bits_per_weight_of_compressed_tensors_by_group_size():
    """4-bit codes + a 16-bit scale per group + (asymmetric) a 4-bit zero point per group."""
    ct = formats.COMPRESSED_TENSORS
    assert [ct.bits_per_weight(g, 4, False) for g in (128, 64, 32)] == [4.15625, 4.3125, 4.625]
    assert [ct.bits_per_weight(g, 4, True) for g in (128, 64, 32)] == [4.125, 4.25, 4.5]


# ---- what is written ----

def test_compressed_tensors_config_has_one_group_per_size_naming_its_linears():
    ct = formats.COMPRESSED_TENSORS
    r = Recipe(**BASE)
    one = ct.quantization_config(r, [])
    assert [g["targets"] for g in one["config_groups"].values()] == [["Linear"]]
    cfg = ct.quantization_config(r, [], {"m.l.0.q": 32, "m.l.0.o": 64, "m.l.0.k": 32})
    groups = list(cfg["config_groups"].values())
    assert [(g["weights"]["group_size"], g["targets"]) for g in groups] == [(64, ["m.l.0.o"]),
                                                                          (32, ["m.l.0.k", "m.l.0.q"])]
    assert cfg["ignore"] == ["lm_head"]
    with pytest.raises(ValueError, match="holds one group size"):
        formats.AWQ.quantization_config(r, [], {"a": 32, "b": 64})
