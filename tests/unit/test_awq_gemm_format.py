import torch

from quantize.formats import awq_gemm


def test_golden_nibble_order():
    # Columns 0..7 hold codes 1..8. vLLM reads nibble i as column AWQ_ORDER[i] = [0,2,4,6,1,3,5,7][i], so the
    # nibbles from low to high are 1,3,5,7,2,4,6,8 -> 0x86427531 (negative as int32).
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    packed = awq_gemm.pack_int4_cols(codes)
    assert packed.dtype == torch.int32
    assert packed.tolist() == [[0x86427531 - 2**32]]
    # column 8c + j lands in int32 c
    codes2 = torch.tensor([[0] * 8 + [15, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert awq_gemm.pack_int4_cols(codes2).tolist() == [[0, 0xF]]


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
    assert awq_gemm.pack_int4_cols(codes).item() != plain


def test_quantization_config_keys():
    cfg = awq_gemm.quantization_config(4, 128, True, ["lm_head"])
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": ["lm_head"]}
