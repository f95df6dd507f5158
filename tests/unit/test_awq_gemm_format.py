import pytest
import torch

from quantize.formats import awq_gemm
from quantize.formats.awq_gemm import AWQ_ORDER
from quantize.formats.packing import pack_int32, unpack_int32


def test_golden_nibble_order():
    # Columns 0..7 hold codes 1..8. vLLM reads nibble i as column AWQ_ORDER[i] = [0,2,4,6,1,3,5,7][i], so the
    # nibbles from low to high are 1,3,5,7,2,4,6,8 -> 0x86427531 (negative as int32).
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    packed = pack_int32(codes, 4, AWQ_ORDER)
    assert packed.dtype == torch.int32
    assert packed.tolist() == [[0x86427531 - 2**32]]
    # column 8c + j lands in int32 c
    codes2 = torch.tensor([[0] * 8 + [15, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert pack_int32(codes2, 4, AWQ_ORDER).tolist() == [[0, 0xF]]
    assert torch.equal(unpack_int32(packed, 4, AWQ_ORDER), codes.long())


def test_pack_unpack_round_trip_and_shapes():
    g, out_f, in_f = 64, 48, 256
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (out_f, in_f // g), generator=gen, dtype=torch.int32)
    scales = torch.rand(out_f, in_f // g, generator=gen).half()
    packed = awq_gemm.pack(codes, scales, zeros)
    assert packed["qweight"].shape == (in_f, out_f // 8) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (in_f // g, out_f // 8) and packed["qzeros"].dtype == torch.int32
    assert packed["scales"].shape == (in_f // g, out_f) and packed["scales"].dtype == torch.float16
    c2, s2, z2 = awq_gemm.unpack(packed)
    assert torch.equal(c2, codes) and torch.equal(z2, zeros) and torch.equal(s2, scales)


def test_wrong_order_would_be_detected():
    # A plain (unpermuted) nibble order gives different bits for the same codes: the golden test can fail.
    codes = torch.arange(8, dtype=torch.uint8).view(1, 8)
    plain = sum(int(v) << (4 * i) for i, v in enumerate(codes[0]))
    assert pack_int32(codes, 4, AWQ_ORDER).item() != plain == pack_int32(codes, 4).item()


def test_quantization_config_keys():
    cfg = awq_gemm.quantization_config(4, 128, False, ["lm_head"])  # asymmetric: zero_point true
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": ["lm_head"]}


def test_packer_golden_plain_order_8bit_and_padding():
    """The one packer with no order (GPTQ, compressed-tensors, checkpoints): value j at bits b·j; 8-bit words
    hold four values; a row 32/b does not divide is padded with zeros, and unpacking drops the padding."""
    assert pack_int32(torch.arange(1, 9).view(1, 8), 4).item() == 0x87654321 - 2**32
    assert pack_int32(torch.tensor([[1, 2, 3, 4]]), 8).item() == 0x04030201
    odd = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    packed = pack_int32(odd, 4)
    assert packed.tolist() == [[0x87654321 - 2**32, 0xA9]]
    assert torch.equal(unpack_int32(packed, 4, cols=10), odd)


@pytest.mark.parametrize("bits", [4, 8])
def test_packer_round_trip(bits):
    x = torch.randint(0, 2**bits, (6, 64), generator=torch.Generator().manual_seed(0))
    for order in (None, AWQ_ORDER if bits == 4 else None):
        assert torch.equal(unpack_int32(pack_int32(x, bits, order), bits, order), x)


def test_checkpoint_codes_round_trip():
    """Per-layer checkpoints store 4-bit codes two to a byte, wider codes as they are."""
    from quantize.methods.job import _from_nibbles, _nibbles

    gen = torch.Generator().manual_seed(0)
    four = torch.randint(0, 16, (4, 64), generator=gen, dtype=torch.uint8)
    eight = torch.randint(0, 256, (4, 64), generator=gen, dtype=torch.uint8)
    assert set(_nibbles(four)) == {"u4"} and _nibbles(four)["u4"].numel() == four.numel() // 2
    assert set(_nibbles(eight)) == {"raw"}
    for codes in (four, eight):
        back = _from_nibbles(_nibbles(codes))
        assert back.dtype == torch.uint8 and torch.equal(back, codes)
