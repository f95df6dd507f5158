import re

import pytest
import torch

from quantize.formats import compressed_tensors as ct
from quantize.formats import gptq


def _rand(out_f=64, in_f=256, g=64, bits=4, seed=0, symmetric=True):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=gen, dtype=torch.uint8)
    n = in_f // g
    zeros = (torch.full((out_f, n), 2 ** (bits - 1), dtype=torch.int32) if symmetric
             else torch.randint(0, 2**bits, (out_f, n), generator=gen, dtype=torch.int32))
    scales = torch.rand(out_f, n, generator=gen).half()
    return codes, scales, zeros


def test_gptq_golden_and_layout():
    # input rows 0..7 of output column 0 hold 1..8: nibble j = row j, low bits first -> 0x87654321
    codes = torch.zeros(8, 8, dtype=torch.uint8)  # [out, in]
    codes[0, :] = torch.arange(1, 9, dtype=torch.uint8)
    p = gptq.pack(codes, torch.ones(8, 1).half(), torch.full((8, 1), 8, dtype=torch.int32), 4)
    assert p["qweight"].shape == (1, 8) and p["qweight"][0, 0].item() == 0x87654321 - 2**32
    assert p["qzeros"].shape == (1, 1) and p["qzeros"].item() == 0x77777777  # v1: zero - 1, symmetric 8 -> 7
    assert p["g_idx"].tolist() == [0] * 8


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_round_trip(bits):
    codes, scales, zeros = _rand(bits=bits)
    p = gptq.pack(codes, scales, zeros, bits)
    assert p["qweight"].shape == (256 * bits // 32, 64) and p["scales"].shape == (4, 64)
    assert p["qzeros"].shape == (4, 64 * bits // 32) and p["g_idx"].shape == (256,)
    c, s, z = gptq.unpack(p, bits)
    assert torch.equal(c, codes) and torch.equal(s, scales) and torch.equal(z, zeros)


def test_gptq_permuted_g_idx_refused_without_desc_act_and_decoded_with_it():
    """Act-order (a tool's desc_act: true): row i takes group g_idx[i]'s scale. The same g_idx under desc_act:
    false is refused, naming g_idx: vLLM would read it as contiguous groups."""
    from quantize.formats import GPTQ
    from quantize.formats.checks import TensorError

    codes, scales, _ = _rand()
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    g_idx = (torch.argsort(perm) // 64).to(torch.int32)  # row perm[p] is the p-th in activation order
    p = {**gptq.pack(codes, scales, torch.full((64, 4), 8, dtype=torch.int32), 4), "g_idx": g_idx}
    with pytest.raises(TensorError, match="desc_act: true") as e:
        GPTQ.decode(p, {"sym": True, "desc_act": False}, 4)
    assert e.value.tensor == "g_idx"
    w = GPTQ.decode(p, {"sym": True, "desc_act": True}, 4)
    want = (codes.float() - 8) * scales.float()[:, g_idx.long()]
    assert torch.equal(w, want)


@pytest.mark.parametrize("tensor, change, problem", [
    ("qweight", lambda t: t[:-1], "expected [248] from qweight [31, 64] at 4 bits (248 input features)"), ("scales", lambda t: t[:, :-1], "expected [4, 64] from qweight"),
    ("qzeros", lambda t: t.float(), "not packed int32"), ("qzeros", None, "is missing"),
])
def test_gptq_tensors_that_do_not_fit_the_layout_are_named(tensor, change, problem):
    from quantize.formats import GPTQ
    from quantize.formats.checks import TensorError

    p = gptq.pack(*_rand(), 4)
    if change is None:
        del p[tensor]
    else:
        p[tensor] = change(p[tensor])
    with pytest.raises(TensorError, match=re.escape(problem)) as e:
        GPTQ.decode(p, {"sym": True}, 4)
    assert e.value.tensor == (tensor if tensor != "qweight" else "g_idx")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_round_trip(bits, symmetric):
    codes, scales, zeros = _rand(bits=bits, symmetric=symmetric)
    p = ct.pack(codes, scales, zeros, bits, symmetric)
    assert p["weight_packed"].shape == (64, 256 * bits // 32) and p["weight_packed"].dtype == torch.int32
    assert p["weight_shape"].tolist() == [64, 256]
    assert ("weight_zero_point" in p) == (not symmetric)
    if not symmetric:
        assert p["weight_zero_point"].shape == (64 * bits // 32, 4)
    c, s, z = ct.unpack(p, bits)
    assert torch.equal(c, codes) and torch.equal(s, scales) and torch.equal(z, zeros)


def test_compressed_tensors_golden():
    # signed code + 8 packed along `in`, low bits first: codes 1..8 -> 0x87654321
    codes = torch.arange(1, 9, dtype=torch.uint8).view(1, 8)
    p = ct.pack(codes, torch.ones(1, 1).half(), torch.full((1, 1), 8, dtype=torch.int32), 4, True)
    assert p["weight_packed"].item() == 0x87654321 - 2**32


def test_compressed_tensors_config():
    cfg = ct.quantization_config(4, 128, False, True, ["lm_head"])
    w = cfg["config_groups"]["group_0"]["weights"]
    assert cfg["format"] == "pack-quantized" and cfg["quant_method"] == "compressed-tensors"
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"], w["actorder"]) == (
        4, 128, False, "group", "static")


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_bits_equal_the_packages_own(bits):
    """Our packer writes what compressed_tensors' compressor writes, zero points along an `out` that 32/b does
    not divide (padded) included."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    codes, scales, zeros = _rand(out_f=36, bits=bits, symmetric=False)
    p = ct.pack(codes, scales, zeros, bits, False)
    off = 2 ** (bits - 1)
    signed = lambda t: (t.to(torch.int16) - off).to(torch.int8)  # noqa: E731 - the package takes signed int8
    assert torch.equal(p["weight_packed"], helpers.pack_to_int32(signed(codes), bits))
    assert torch.equal(p["weight_zero_point"], helpers.pack_to_int32(signed(zeros), bits, packed_dim=0))
    c, s, z = ct.unpack(p, bits)
    assert torch.equal(c, codes) and torch.equal(z, zeros)
