"""Output formats: one `Format` per on-disk layout vLLM reads, found by name with `get`.

A Format holds every fact about its layout: which recipes it can hold (bits, group sizes, symmetry, AWQ
version) with the message that says what to change; how a converted linear is packed, and read back the way
vLLM decodes it; its config.json `quantization_config`, 16-bit linears named as its reader needs; its tensor
names; the names vLLM serves it under; the CUDA kernel pre-flight expects for each linear. Any method's
results can be written in any format. The tensor layouts are in awq_gemm.py, gptq.py and
compressed_tensors.py, all packed by packing.py. Facts checked on vLLM 0.32 (../shared/VLLM.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The facts here import no torch (recipe validation and the command line's light commands read them); the
# layout modules (awq_gemm, gptq, compressed_tensors) and the decoders' maths are imported where they run.

# vLLM's Marlin kernels (marlin_utils): these group sizes, in_features divisible by 128 and by the group size,
# out_features divisible by 64
MARLIN_GROUPS = (-1, 32, 64, 128)
MARLIN_MIN_K, MARLIN_MIN_N = 128, 64


def marlin_misfit(in_f: int, out_f: int, group: int) -> str:
    """Why Marlin's tiles cannot take a linear [out, in] at this group size; "" when they can."""
    if group in MARLIN_GROUPS and in_f % MARLIN_MIN_K == 0 and out_f % MARLIN_MIN_N == 0 and (
            group == -1 or in_f % group == 0):
        return ""
    return f"in {in_f} % 128, out {out_f} % 64 or group {group} breaks Marlin's tiles"


def _act_order(recipe) -> bool:
    """Columns were quantized in activation order (static: groups stay contiguous): the recipe's method says."""
    return recipe.static_act_order


@dataclass(frozen=True)
class Format:
    """The facts of one on-disk format; subclasses add its layout code."""

    name: str  # the recipe's `format:` and the manifest's format.name
    quant_method: str  # config.json quantization_config.quant_method
    title: str  # how the model card names it
    bits: tuple[int, ...]  # w_bit values vLLM serves in this format
    group_sizes: tuple[int, ...]  # q_group_size values it serves (-1 = per output channel)
    symmetric_only: bool  # vLLM refuses its checkpoints with zero points
    packed_tensor: str  # the int32 code tensor whose presence marks a converted linear
    tensors: tuple[str, ...]  # every tensor suffix a converted linear may have
    served_as: tuple[str, str]  # vLLM --quantization: when every linear takes Marlin, and otherwise
    reported_as: frozenset[str]  # quantization names vLLM may log while serving it (CPU and CUDA builds differ)
    pack_along_out: int = 1  # out_features must divide by this (AWQ GEMM packs 8 codes per int32 along out)
    index_bytes_per_input: int = 0  # bytes per input feature of an index tensor (GPTQ's g_idx, int32)

    def problem(self, recipe) -> str | None:
        """Why vLLM cannot serve `recipe`'s weights in this format, saying what to change; None when it can."""
        if recipe.w_bit not in self.bits:
            return f"w_bit {recipe.w_bit} is not allowed with format {self.name}: vLLM serves {list(self.bits)}"
        return self._group_problem(recipe)

    def _group_problem(self, recipe) -> str | None:
        g = recipe.q_group_size
        if g in self.group_sizes:
            return None
        *most, last = self.group_sizes
        return (f"q_group_size {g}{' (per channel)' if g == -1 else ''} is not served in format {self.name}; use "
                f"{', '.join(map(str, most))} or {last}")

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
             symmetric: bool) -> dict[str, torch.Tensor]:
        """codes [out, in] uint8, scales/zeros [out, n_group] -> {tensor suffix: tensor} of one linear."""
        raise NotImplementedError

    def quantization_config(self, recipe, unconverted: list[str]) -> dict:
        """config.json's `quantization_config`; unconverted: full names of every decoder linear kept 16-bit."""
        raise NotImplementedError

    def read_config(self, qcfg: dict) -> int:
        """A quantization_config of this format (any tool's) -> its bit width; ValueError if we cannot decode it."""
        raise NotImplementedError

    def decode(self, tensors: dict[str, torch.Tensor], qcfg: dict, bits: int) -> torch.Tensor:
        """One linear's tensors {suffix: tensor} -> its weight [out, in] (float32), as vLLM computes with it."""
        raise NotImplementedError

    def cuda_kernel(self, in_f: int, out_f: int, group: int, symmetric: bool) -> tuple[str, str]:
        """The kernel CUDA vLLM runs a linear [out, in] with -> (kernel, why not Marlin, or "")."""
        raise NotImplementedError


@dataclass(frozen=True)
class AwqGemm(Format):
    versions: tuple[str, ...] = ("gemm",)  # AutoAWQ layouts vLLM reads
    refused_versions: tuple[tuple[str, str], ...] = ()  # (version, why vLLM cannot read it)

    def problem(self, recipe) -> str | None:
        if recipe.w_bit not in self.bits:
            return (f"w_bit {recipe.w_bit} is not allowed with format awq (AutoAWQ GEMM): vLLM serves only "
                    f"w_bit {list(self.bits)} in that format; use format: compressed-tensors for 8-bit")
        refused = dict(self.refused_versions)
        if recipe.version in refused:
            return f"version {recipe.version!r} is refused: {refused[recipe.version]}; use version: gemm"
        if recipe.version not in self.versions:
            return f"version {recipe.version!r} is unknown; use one of {list(self.versions)}"
        return self._group_problem(recipe)

    def pack(self, codes, scales, zeros, bits, symmetric):
        from . import awq_gemm

        return awq_gemm.pack(codes, scales, zeros)

    def quantization_config(self, recipe, unconverted):
        own = list(recipe.modules_to_not_convert)
        extra = [n for n in unconverted if not any(m in n for m in own)]  # vLLM matches entries as substrings
        from . import awq_gemm

        return awq_gemm.quantization_config(recipe.w_bit, recipe.q_group_size, recipe.symmetric, own + extra)

    def read_config(self, qcfg):
        version = str(qcfg.get("version", "")).lower()
        if version not in self.versions:
            raise ValueError(f"AWQ version {version!r} is not readable here (gemm only)")
        bits = int(qcfg.get("bits", qcfg.get("w_bit", 0)))
        if bits not in self.bits:
            raise ValueError(f"bits {bits} is not supported by the AWQ GEMM reader (4 only)")
        return bits

    def decode(self, tensors, qcfg, bits):
        import torch

        from ..primitives import dequantize, symmetric_zero
        from . import awq_gemm

        codes, scales, zeros = awq_gemm.unpack(tensors)
        if not qcfg.get("zero_point", True):
            zeros = torch.full_like(zeros, symmetric_zero(bits))  # vLLM ignores qzeros without zero points
        return dequantize(codes, scales, zeros)

    def cuda_kernel(self, in_f, out_f, group, symmetric):
        # vLLM pads tile-misaligned AWQ layers for Marlin (allow_tile_padding=True)
        return ("awq_marlin", "") if group in MARLIN_GROUPS else ("awq (gemm)", marlin_misfit(in_f, out_f, group))


@dataclass(frozen=True)
class Gptq(Format):
    def problem(self, recipe) -> str | None:
        if (bad := super().problem(recipe)) is not None:
            return bad
        if self.symmetric_only and not recipe.symmetric:
            return ("zero_point true (asymmetric) is not allowed with format gptq: vLLM 0.32 accepts only sym: true "
                    "GPTQ checkpoints; set zero_point: false, or format: compressed-tensors for asymmetric weights")
        return None

    def pack(self, codes, scales, zeros, bits, symmetric):
        from . import gptq

        return gptq.pack(codes, scales, zeros, bits)

    def quantization_config(self, recipe, unconverted):
        # 16-bit linears need no key: vLLM takes a linear with no integer tensor in the checkpoint as unquantized
        from . import gptq

        o = recipe.gptq
        return gptq.quantization_config(recipe.w_bit, recipe.q_group_size, recipe.symmetric, _act_order(recipe),
                                        o.true_sequential, o.damp_percent)

    def read_config(self, qcfg):
        if qcfg.get("desc_act"):
            raise ValueError("desc_act: true GPTQ checkpoints are rejected by vLLM 0.32")
        return int(qcfg["bits"])

    def decode(self, tensors, qcfg, bits):
        import torch

        from ..primitives import dequantize, symmetric_zero
        from . import gptq

        codes, scales, zeros = gptq.unpack(tensors, bits)
        if qcfg.get("sym", True):
            zeros = torch.full_like(zeros, symmetric_zero(bits))  # vLLM ignores qzeros with sym
        return dequantize(codes, scales, zeros)

    def cuda_kernel(self, in_f, out_f, group, symmetric):
        why = marlin_misfit(in_f, out_f, group)
        return ("gptq_marlin", "") if not why and symmetric else ("gptq (exllama)", why or "asymmetric")


@dataclass(frozen=True)
class CompressedTensors(Format):
    def pack(self, codes, scales, zeros, bits, symmetric):
        from . import compressed_tensors

        return compressed_tensors.pack(codes, scales, zeros, bits, symmetric)

    def quantization_config(self, recipe, unconverted):
        # vLLM expects packed tensors for every linear `ignore` does not name
        from . import compressed_tensors

        return compressed_tensors.quantization_config(recipe.w_bit, recipe.q_group_size, recipe.symmetric,
                                                      _act_order(recipe), ["lm_head", *unconverted])

    def read_config(self, qcfg):
        if qcfg.get("format") != "pack-quantized":
            raise ValueError(f"compressed-tensors format {qcfg.get('format')!r} is not readable here")
        groups = list(qcfg.get("config_groups", {}).values())
        return int(groups[0]["weights"]["num_bits"])

    def decode(self, tensors, qcfg, bits):
        from ..primitives import dequantize
        from . import compressed_tensors

        return dequantize(*compressed_tensors.unpack(tensors, bits))

    def cuda_kernel(self, in_f, out_f, group, symmetric):
        why = marlin_misfit(in_f, out_f, group)
        return ("compressed-tensors fallback kernel", why) if why else ("marlin (compressed-tensors wNa16)", "")


AWQ = AwqGemm(
    name="awq", quant_method="awq", title="AutoAWQ GEMM (quant_method awq)", bits=(4,),
    group_sizes=(32, 64, 128), symmetric_only=False, packed_tensor="qweight",
    tensors=("qweight", "qzeros", "scales"), served_as=("awq_marlin", "awq"),
    reported_as=frozenset({"awq", "awq_marlin", "auto_awq"}), pack_along_out=8,
    refused_versions=(
        ("gemv", "vLLM cannot load AutoAWQ GEMV layouts"),
        ("gemv_fast", "vLLM cannot load AutoAWQ GEMV-fast layouts"),
        ("marlin", "vLLM cannot load AutoAWQ's pre-packed Marlin layout (it repacks GEMM checkpoints itself)"),
        ("exllama", "AutoAWQ's ExLlama layout is a runtime kernel choice, not a checkpoint format vLLM reads"),
    ),
)
GPTQ = Gptq(
    name="gptq", quant_method="gptq", title="GPTQ v1 (quant_method gptq)", bits=(4, 8),
    group_sizes=(-1, 32, 64, 128), symmetric_only=True, packed_tensor="qweight",
    tensors=("qweight", "qzeros", "scales", "g_idx"), served_as=("gptq_marlin", "gptq"),
    reported_as=frozenset({"gptq", "gptq_marlin", "auto_gptq"}), index_bytes_per_input=4,
)
COMPRESSED_TENSORS = CompressedTensors(
    name="compressed-tensors", quant_method="compressed-tensors", title="compressed-tensors pack-quantized",
    bits=(4, 8), group_sizes=(-1, 32, 64, 128), symmetric_only=False, packed_tensor="weight_packed",
    tensors=("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    served_as=("compressed-tensors", "compressed-tensors"),
    reported_as=frozenset({"compressed-tensors", "compressed_tensors"}),
)

REGISTRY: dict[str, Format] = {f.name: f for f in (AWQ, GPTQ, COMPRESSED_TENSORS)}
NAMES = tuple(REGISTRY)


def get(name: str) -> Format:
    """The format a recipe or manifest names."""
    if name not in REGISTRY:
        raise ValueError(f"format {name!r} is unknown; use one of {list(NAMES)}")
    return REGISTRY[name]


def by_quant_method(quant_method: str | None) -> Format | None:
    """The format of a config.json's quantization_config.quant_method (any tool's), or None if none of ours."""
    return next((f for f in REGISTRY.values() if f.quant_method == quant_method), None)
