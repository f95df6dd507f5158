"""Output formats: one `Format` per on-disk layout vLLM reads, found by name with `get`.

A Format holds every fact about its layout: which recipes it can hold (bits, group sizes, symmetry, AWQ
version) with the message that says what to change; how a converted linear is packed, and read back the way
vLLM decodes it; its config.json `quantization_config`, 16-bit linears named as its reader needs; its tensor
names; the names vLLM serves it under; the CUDA kernel pre-flight expects for each linear. Any method's
results can be written in any format. The tensor layouts are in awq_gemm.py, gptq.py and
compressed_tensors.py, all packed by packing.py. Layout facts checked on vLLM 0.32 (../shared/VLLM.md); the kernel
rules hold for vLLM 0.26 (the CUDA build) and 0.32 alike, and what differs between the two is in
preflight/rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The facts here import no torch (recipe validation and the command line's light commands read them); the
# layout modules (awq_gemm, gptq, compressed_tensors) and the decoders' maths are imported where they run.
from .kernels import FALLBACK, MARLIN, MARLIN_GROUPS, REFUSED, _mp_kernel, marlin_misfit, moe_marlin_misfit


def is_skipped(name: str, modules_to_not_convert: tuple[str, ...]) -> bool:
    """vLLM's rule for AWQ: a module is left unconverted when any entry is a substring of its name."""
    return any(m in name for m in modules_to_not_convert)


def words(n: int, bits: int) -> int:
    """int32 words that hold n codes of `bits` bits packed end to end."""
    return -(-n * bits // 32)


def n_groups(in_f: int, group: int) -> int:
    """Quantization groups along a linear's in_features (-1: one per output channel)."""
    return 1 if group == -1 else -(-in_f // group)


SCALE_BYTES = 2  # scales are stored in the recipe's 16-bit dtype (float16 or bfloat16)


def _act_order(recipe) -> bool:
    """Columns were quantized in activation order (static: groups stay contiguous): the recipe's method says."""
    return bool(getattr(recipe, "static_act_order", False))  # a plain namespace (deploy.py) has none


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
    several_group_sizes: bool = False  # one artifact may hold linears of different group sizes (`mixed:`)

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

    def quantization_config(self, recipe, unconverted: list[str], groups: dict[str, int] | None = None) -> dict:
        """config.json's `quantization_config`; unconverted: full names of every decoder linear kept 16-bit;
        groups: checkpoint name -> group size of each converted linear where they differ (`mixed:`), else None."""
        raise NotImplementedError

    def linear_bytes(self, out_f: int, in_f: int, group: int, bits: int, symmetric: bool) -> int:
        """Bytes this layout writes for one converted linear [out, in]: codes, scales, zero points and any
        per-linear tensor, as `pack` makes them (tests/unit/test_mixed.py holds it to their sizes)."""
        raise NotImplementedError

    def group_bits(self, group: int, bits: int, symmetric: bool) -> float:
        """Bits per weight the per-group tensors add to the codes' `bits` (scales, zero points): what
        8 · linear_bytes / (out · in) tends to for a large linear, before any shape is known."""
        raise NotImplementedError

    def bits_per_weight(self, group: int, bits: int, symmetric: bool, shape: tuple[int, int] | None = None) -> float:
        """Stored bits per weight of a converted linear: comparisons' "bits / weight" (every byte of the quantized
        linears x 8 / their weights). shape (out, in): exactly as written; None: the large-linear limit."""
        if shape is None:
            return bits + self.group_bits(group, bits, symmetric)
        out_f, in_f = shape
        return 8 * self.linear_bytes(out_f, in_f, group, bits, symmetric) / (out_f * in_f)

    def read_config(self, qcfg: dict) -> int:
        """A quantization_config of this format (any tool's) -> its bit width; ValueError if we cannot decode it."""
        raise NotImplementedError

    def decode(self, tensors: dict[str, torch.Tensor], qcfg: dict, bits: int) -> torch.Tensor:
        """One linear's tensors {suffix: tensor} -> its weight [out, in] (float32), as vLLM computes with it."""
        raise NotImplementedError

    def cuda_kernel(self, in_f: int, out_f: int, group: int, symmetric: bool) -> tuple[str, str]:
        """The --quantization method CUDA vLLM serves a linear [out, in] with on one GPU -> (method, why not
        Marlin-class, or "")."""
        marlin, fallback = self.served_as
        refused = self.config_refusal(4, group, symmetric)
        if refused:
            return fallback, refused
        tier, _kernel, why = self.cuda_rule(in_f, in_f, out_f, group, symmetric, 80, "float16")
        return (marlin, "") if tier == MARLIN else (fallback, why)

    def config_refusal(self, w_bit: int, group: int, symmetric: bool) -> str | None:
        """Why vLLM refuses a checkpoint of this format whatever the GPU (its config), or None."""
        return None

    def cuda_rule(self, in_f: int, in_pp: int, out_pp: int, group: int, symmetric: bool, cc: int,
                  dtype: str) -> tuple[str, str, str]:
        """The kernel CUDA vLLM runs a linear with (in_f inputs, in_pp / out_pp per GPU) at compute capability
        cc (e.g. 90) -> (tier, kernel, why not Marlin-class / why refused)."""
        return _mp_kernel(in_f, in_pp, out_pp, group, not symmetric, cc, dtype, exllama=symmetric)

    def moe_rule(self, hidden: int, inter_pp: int, group: int, symmetric: bool) -> tuple[str, str, str]:
        """The kernel CUDA vLLM runs a fused MoE block with -> (tier, kernel, why not Marlin-class)."""
        why = moe_marlin_misfit(hidden, inter_pp, group)
        if not why:
            return MARLIN, "Marlin MoE", ""
        # vLLM's MoE WNA16 fallback halves the group size until it divides both sizes, down to 32 at least
        if group > 0 and (inter_pp % 32 or hidden % 32):
            return REFUSED, "", (f"{why}, and the MoE WNA16 fallback needs the hidden size ({hidden}) and the "
                                 f"expert intermediate size per GPU ({inter_pp}) divisible by 32")
        return FALLBACK, "Triton WNA16 MoE", why


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

    def linear_bytes(self, out_f, in_f, group, bits, symmetric):
        g, w = n_groups(in_f, group), words(out_f, bits)  # qzeros are written with or without zero points
        return 4 * in_f * w + 4 * g * w + SCALE_BYTES * g * out_f  # qweight, qzeros, scales

    def group_bits(self, group, bits, symmetric):
        return (8 * SCALE_BYTES + bits) / group

    def quantization_config(self, recipe, unconverted, groups=None):
        _one_group_size(self, groups)
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

        from ..methods.primitives import dequantize, symmetric_zero
        from . import awq_gemm

        codes, scales, zeros = awq_gemm.unpack(tensors)
        if not qcfg.get("zero_point", True):
            zeros = torch.full_like(zeros, symmetric_zero(bits))  # vLLM ignores qzeros without zero points
        return dequantize(codes, scales, zeros)

    def cuda_rule(self, in_f, in_pp, out_pp, group, symmetric, cc, dtype):
        # vLLM's AWQ Marlin path needs zero points (Marlin takes uint4 only with them); otherwise, or when a
        # group would span two GPUs, it falls back to its unoptimized AWQ GEMM kernel, which needs whole groups
        # and 8 outputs per int32 on each GPU
        why = "" if not symmetric else "without zero points vLLM does not use Marlin for AWQ"
        why = why or marlin_misfit(in_f, in_pp, group)
        if not why:
            return _mp_kernel(in_f, in_pp, out_pp, group, True, cc, dtype, exllama=False)
        g = in_f if group == -1 else group
        if in_pp % g or out_pp % self.pack_along_out:
            return REFUSED, "", (f"{why}; the AWQ GEMM fallback needs in_features per GPU ({in_pp}) divisible by "
                                 f"the group size and out_features per GPU ({out_pp}) by 8")
        return FALLBACK, "AWQ GEMM", why

    def moe_rule(self, hidden, inter_pp, group, symmetric):
        if group == -1:  # vLLM's AWQ MoE method sizes its scales by hidden // group: no per-channel AWQ experts
            return REFUSED, "", "vLLM's AWQ MoE layers take no per-channel (group -1) scales"
        return super().moe_rule(hidden, inter_pp, group, symmetric)


@dataclass(frozen=True)
class Gptq(Format):
    def problem(self, recipe) -> str | None:
        if (bad := super().problem(recipe)) is not None:
            return bad
        if self.symmetric_only and not recipe.symmetric:
            return ("zero_point true (asymmetric) is not allowed with format gptq: vLLM (0.26 and 0.32 alike) accepts "
                    "only sym: true GPTQ checkpoints; set zero_point: false, or format: compressed-tensors for "
                    "asymmetric weights")
        return None

    def pack(self, codes, scales, zeros, bits, symmetric):
        from . import gptq

        return gptq.pack(codes, scales, zeros, bits)

    def linear_bytes(self, out_f, in_f, group, bits, symmetric):
        g = n_groups(in_f, group)  # qweight, qzeros (always written), scales, g_idx
        return 4 * words(in_f, bits) * out_f + 4 * g * words(out_f, bits) + SCALE_BYTES * g * out_f + 4 * in_f

    def group_bits(self, group, bits, symmetric):
        return (8 * SCALE_BYTES + bits) / (group if group != -1 else float("inf"))

    def quantization_config(self, recipe, unconverted, groups=None):
        _one_group_size(self, groups)
        # 16-bit linears need no key: vLLM takes a linear with no integer tensor in the checkpoint as unquantized
        from . import gptq

        o = recipe.gptq
        return gptq.quantization_config(recipe.w_bit, recipe.q_group_size, recipe.symmetric, _act_order(recipe),
                                        o.true_sequential, o.damp_percent)

    def read_config(self, qcfg):
        # desc_act: true is decoded (each row's group from g_idx) though vLLM 0.32 refuses to serve it: the eval
        # scores such a directory and its vLLM smoke test reports the refusal
        layout = qcfg.get("checkpoint_format", "gptq")
        if layout not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {layout!r} is not readable here (gptq or gptq_v2)")
        bits = int(qcfg.get("bits", 0))
        if bits not in self.bits:
            raise ValueError(f"bits {bits} is not readable by the GPTQ reader ({list(self.bits)})")
        return bits

    def decode(self, tensors, qcfg, bits):
        import torch

        from ..methods.primitives import dequantize, dequantize_by_index, symmetric_zero
        from . import gptq

        codes, scales, zeros = gptq.unpack(tensors, bits)
        g_idx = gptq.group_index(tensors, bits, bool(qcfg.get("desc_act")))
        if qcfg.get("sym", True):
            zeros = torch.full_like(zeros, symmetric_zero(bits))  # vLLM ignores qzeros with sym
        elif qcfg.get("checkpoint_format") == "gptq_v2":
            zeros = zeros - 1  # v2 stores the zero point itself, not zero - 1
        return dequantize(codes, scales, zeros) if g_idx is None else dequantize_by_index(codes, scales, zeros, g_idx)

    def config_refusal(self, w_bit, group, symmetric):
        if not symmetric:
            # AutoGPTQConfig.TYPE_MAP holds (4, True) and (8, True) only, in vLLM 0.26 and 0.32 alike
            return f"Unsupported quantization config: bits={w_bit}, sym=False (vLLM serves symmetric GPTQ only)"
        if group not in MARLIN_GROUPS:
            return f"GPTQ needs a Marlin group size {list(MARLIN_GROUPS)}, not {group}"
        return None


@dataclass(frozen=True)
class CompressedTensors(Format):
    def cuda_rule(self, in_f, in_pp, out_pp, group, symmetric, cc, dtype):
        # whatever kernel vLLM picks, its compressed-tensors WNA16 scheme then refuses a group split between GPUs
        tier, kernel, why = super().cuda_rule(in_f, in_pp, out_pp, group, symmetric, cc, dtype)
        if group != -1 and in_pp % group:
            return REFUSED, "", f"in_features per GPU {in_pp} is not a multiple of group size {group}"
        return tier, kernel, why

    def moe_rule(self, hidden, inter_pp, group, symmetric):
        if group != -1 and (hidden % group or inter_pp % group):
            return REFUSED, "", (f"compressed-tensors MoE needs the hidden size ({hidden}) and the expert "
                                 f"intermediate size per GPU ({inter_pp}) divisible by group size {group}")
        return super().moe_rule(hidden, inter_pp, group, symmetric)

    def pack(self, codes, scales, zeros, bits, symmetric):
        from . import compressed_tensors

        return compressed_tensors.pack(codes, scales, zeros, bits, symmetric)

    def linear_bytes(self, out_f, in_f, group, bits, symmetric):
        g = n_groups(in_f, group)  # weight_packed, weight_scale, weight_shape (int64 [2]), weight_zero_point
        zeros = 0 if symmetric else 4 * words(out_f, bits) * g
        return 4 * out_f * words(in_f, bits) + SCALE_BYTES * out_f * g + 16 + zeros

    def group_bits(self, group, bits, symmetric):
        return (8 * SCALE_BYTES + (0 if symmetric else bits)) / (group if group != -1 else float("inf"))

    def quantization_config(self, recipe, unconverted, groups=None):
        # vLLM expects packed tensors for every linear `ignore` does not name; with several group sizes, one
        # config group per size whose targets name its linears (vLLM matches a target equal to the layer's name)
        from . import compressed_tensors

        targets = None
        if groups:
            targets = {}
            for name, g in sorted(groups.items()):
                targets.setdefault(g, []).append(name)
        return compressed_tensors.quantization_config(recipe.w_bit, recipe.q_group_size, recipe.symmetric,
                                                      _act_order(recipe), ["lm_head", *unconverted], targets)

    def read_config(self, qcfg):
        if qcfg.get("format") != "pack-quantized":
            raise ValueError(f"compressed-tensors format {qcfg.get('format')!r} is not readable here")
        groups = list((qcfg.get("config_groups") or {}).values())
        try:
            bits = int(groups[0]["weights"]["num_bits"])
        except (IndexError, KeyError, TypeError, ValueError):
            raise ValueError("config_groups names no weights.num_bits") from None
        if bits not in self.bits:
            raise ValueError(f"num_bits {bits} is not readable by the compressed-tensors reader ({list(self.bits)})")
        return bits

    def decode(self, tensors, qcfg, bits):
        from ..methods.primitives import dequantize, dequantize_by_index
        from . import compressed_tensors

        codes, scales, zeros = compressed_tensors.unpack(tensors, bits)
        g_idx = compressed_tensors.group_index(tensors)
        return dequantize(codes, scales, zeros) if g_idx is None else dequantize_by_index(codes, scales, zeros, g_idx)



def _one_group_size(fmt: Format, groups: dict[str, int] | None) -> None:
    if groups and len(set(groups.values())) > 1:  # the recipe check refuses this first (`mixed:`)
        raise ValueError(f"format {fmt.name} holds one group size; several are written as compressed-tensors")


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
    reported_as=frozenset({"compressed-tensors", "compressed_tensors"}), several_group_sizes=True,
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
