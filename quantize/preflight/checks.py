"""Pre-flight: every converted linear checked against the format and vLLM's kernels before any weight loads.

The model is instantiated on the meta device (shapes only). The result is a `Plan`: which linears are
converted, which are kept in 16-bit and why, and for each converted linear the vLLM kernel it will get.
The CUDA kernel rules are the format's (`formats.Format.cuda_kernel`, checked against vLLM's own selection by
tests/unit/test_deploy_agreement.py); on the CPU build every format runs through the CPU W4A16 kernel. The plan
also holds the deployability table (`deploy`: the kernel per GPU generation x tensor-parallel size) and refuses a
recipe's serve.targets that vLLM would refuse or serve on a fallback.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..files import human_bytes
from .. import formats, methods
from . import deploy, targets
from ..source.arch import Arch, checkpoint_name, decoder_layers, layer_prefix
from ..source.linears import all_linears
from ..source.experts import split_experts
from ..recipe import Recipe

TP_SIZES = (1, 2, 4, 8)
# vLLM's CPU build (CPUWNA16) serves uint4 / uint4b8 only: 8-bit artifacts need a CUDA vLLM (checked 0.32).
CPU_KERNEL = {4: "cpu_wna16", 8: "none: the CPU build serves 4-bit only (CUDA Marlin serves 8-bit)"}
# Routed experts run in vLLM's fused MoE: its CPU build has a 4-bit path only on x86 with AMX tiles (checked
# 0.32: elsewhere start-up fails with "No WNA16 MoE backend supports the deployment configuration").
ROUTER_KEPT = "router: vLLM builds it unquantized"
CPU_MOE_KERNEL = "cpu_int4_moe (needs AMX)"
CPU_MOE_REFUSED = ("vLLM's CPU build refuses 4-bit mixture-of-experts layers on a CPU without AMX ('No WNA16 MoE "
                   "backend supports the deployment configuration'), as this one is: serve the artifact on a CUDA "
                   "host or an AMX CPU (Intel Sapphire Rapids or later)")


def cpu_moe_refusal(plan: "Plan") -> str | None:
    """Why vLLM's CPU build on this host cannot serve the plan's 4-bit experts, or None."""
    if not any(lc.cpu_kernel == CPU_MOE_KERNEL for lc in plan.layers) or torch.cpu._is_amx_tile_supported():
        return None
    return CPU_MOE_REFUSED


class PreflightError(UserError, ValueError):
    pass


@dataclass
class LayerCheck:
    name: str
    in_features: int
    out_features: int
    cuda_kernel: str
    cpu_kernel: str
    note: str = ""


@dataclass
class Plan:
    convert: list[str] = field(default_factory=list)  # full module names that get quantized
    skipped: dict[str, str] = field(default_factory=dict)  # full name -> why it stays 16-bit
    layers: list[LayerCheck] = field(default_factory=list)
    tp_sizes: list[int] = field(default_factory=list)  # tensor-parallel sizes the artifact can be served at
    tied_embeddings: bool = False  # lm_head shares the input embedding: kept tied, 16-bit, not written
    tensor_bytes: int = 0  # estimated bytes of every tensor the artifact will hold
    max_position_embeddings: int | None = None  # the model's context length (serve.max_model_len's bound)
    deploy: dict | None = None  # deploy.Table: the kernel vLLM runs per GPU generation x tensor-parallel size

    def summary(self) -> str:
        kernels: dict[str, int] = {}
        for lc in self.layers:
            kernels[lc.cuda_kernel] = kernels.get(lc.cuda_kernel, 0) + 1
        ks = ", ".join(f"{k}: {v}" for k, v in sorted(kernels.items()))
        cpu = sorted({lc.cpu_kernel for lc in self.layers})
        tied = "; lm_head tied to the input embedding (kept tied and 16-bit)" if self.tied_embeddings else ""
        return (f"{len(self.convert)} linears to convert ({ks} on CUDA; CPU build: {', '.join(cpu)}); "
                f"{len(self.skipped)} kept 16-bit; tensor-parallel sizes OK: {self.tp_sizes}{tied}; "
                f"weights about {human_bytes(self.tensor_bytes)}")

    def table(self) -> str:
        """One row per distinct (linear, shape, kernel) with the number of layers it covers."""
        rows: dict[tuple, int] = {}
        for lc in self.layers:
            local = lc.name.split(".", 3)[-1] if lc.name.count(".") >= 3 else lc.name
            local = re.sub(r"\.experts\.\d+\.", ".experts.*.", local)  # one row for every routed expert
            key = (local, lc.in_features, lc.out_features, lc.cuda_kernel, lc.cpu_kernel, lc.note)
            rows[key] = rows.get(key, 0) + 1
        head = f"{'linear':22s} {'in':>6s} {'out':>6s} {'layers':>6s}  {'CUDA kernel':32s} CPU kernel"
        lines = [head, "-" * len(head)]
        for (local, i, o, ck, cpu, note), n in rows.items():
            lines.append(f"{local:22s} {i:6d} {o:6d} {n:6d}  {ck:32s} {cpu}" + (f"  ({note})" if note else ""))
        routers = [n for n, why in self.skipped.items() if why == ROUTER_KEPT]
        lines += once_per_layer([f"{name}: stays 16-bit: {why}" for name, why in self.skipped.items()
                                 if why not in ("modules_to_not_convert", ROUTER_KEPT)])
        if routers:
            lines.append(f"{len(routers)} MoE routers / shared-expert gates stay 16-bit (vLLM builds them unquantized)")
        if self.tied_embeddings:
            lines.append("lm_head: tied to the input embedding: kept tied and 16-bit (lm_head.weight not written)")
        lines.append(f"tensor-parallel sizes at which every layer stays divisible: {self.tp_sizes}")
        if self.deploy is not None:
            lines.append(deploy.render(deploy.Table.from_dict(self.deploy)))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _tp_sizes(shapes: list[tuple[str, int, int, bool]], group: int) -> list[int]:
    ok = []
    for tp in TP_SIZES:
        fine = True
        for _n, in_f, out_f, row in shapes:
            if row and (in_f % tp or (group != -1 and (in_f // tp) % group)):
                fine = False
            if not row and out_f % tp:
                fine = False
        if fine:
            ok.append(tp)
    return ok


def plan(config, arch: Arch, recipe: Recipe, is_skipped) -> Plan:
    """Shapes of every quantizable linear vs the recipe -> Plan, or PreflightError listing every problem."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.trust_remote_code)
    split_experts(meta, arch)
    fmt, g = formats.get(recipe.out_format), recipe.q_group_size
    others = {**methods.get(recipe.method).group_sizes(recipe),
              **{f"mixed.finer {x}": x for x in (recipe.mixed.finer if recipe.mixed else ())},
              **{f"mixed.coarser {x}": x for x in (recipe.mixed.coarser if recipe.mixed else ()) if x != -1}}
    out, problems, shapes = Plan(), [], []
    linears, fused_sets, row_parallel = _layer_linears(config, arch)
    moe_routed = {n for n in linears if arch.experts is not None and n.startswith(f"{arch.experts.module}.")}
    for i, layer in enumerate(decoder_layers(meta, arch)):
        prefix = layer_prefix(arch, i)
        wanted = {n for n in linears if n not in arch.unquantized
                  and not is_skipped(f"{prefix}.{n}", recipe.modules_to_not_convert)}
        for fused in fused_sets:
            inside = [n in wanted for n in fused]
            if any(inside) and not all(inside):
                problems.append(f"{prefix}: {', '.join(fused)} are loaded by vLLM as one module, so "
                                f"modules_to_not_convert must skip all of them or none")
        bad = set()
        for n in sorted(wanted, key=linears.index):
            out_f, in_f = layer.get_submodule(n).weight.shape
            if (g != -1 and in_f % g) or out_f % fmt.pack_along_out or in_f % (32 // recipe.w_bit):
                bad.add(n)
        for fused in fused_sets:  # a fused set is skipped as a whole
            if bad & set(fused):
                bad |= set(fused) & wanted
        for n in linears:
            full = f"{prefix}.{n}"
            if n not in wanted:
                out.skipped[full] = ("kept 16-bit by the architecture table (quantize/source/arch.py: unquantized)"
                                     if n in arch.unquantized else "modules_to_not_convert")
                continue
            out_f, in_f = layer.get_submodule(n).weight.shape
            if n in bad:
                ok = [x for x in (32, 64, 128) if in_f % x == 0]
                msg = (f"{full}: in_features {in_f} is not divisible by q_group_size {g}"
                       + (f"; q_group_size {ok} would divide it" if ok else ""))
                if out_f % fmt.pack_along_out:
                    msg = (f"{full}: out_features {out_f} is not divisible by {fmt.pack_along_out} (format "
                           f"{fmt.name} packs {fmt.pack_along_out} codes per int32 along out_features)")
                if recipe.on_indivisible == "skip":
                    out.skipped[full] = msg.split(": ", 1)[1] + " (on_indivisible: skip)"
                else:
                    problems.append(msg + "; or set on_indivisible: skip, or add it to modules_to_not_convert")
                continue
            for key, size in others.items():  # a converted linear: on_indivisible does not apply to the key
                if in_f % size:
                    ok = [x for x in (32, 64, 128) if in_f % x == 0]
                    problems.append(f"{full}: in_features {in_f} is not divisible by {key} {size}; use "
                                    f"{' or '.join(map(str, ok)) or 'null'}, or null (q_group_size)")
            kernel, note = fmt.cuda_kernel(in_f, out_f, g, recipe.symmetric)
            out.convert.append(full)
            cpu = CPU_MOE_KERNEL if recipe.w_bit == 4 and n in moe_routed else CPU_KERNEL.get(recipe.w_bit, "none")
            out.layers.append(LayerCheck(full, in_f, out_f, kernel, cpu, note))
            shapes.append((full, in_f, out_f, n in row_parallel))
        for n in arch.experts.unconverted() if arch.experts else ():
            out.skipped[checkpoint_name(arch, f"{prefix}.{n}")] = ROUTER_KEPT
    tp_sizes = _tp_sizes(shapes, g)
    problems += serve_problems(config, recipe, tp_sizes) + mixed_problems(recipe, arch, out.layers)
    if recipe.dtype not in arch.serve_dtypes:
        problems.append(f"dtype {recipe.dtype}: vLLM serves {', '.join(config.architectures or [])} only in "
                        f"{' or '.join(arch.serve_dtypes)}; set dtype: {arch.serve_dtypes[0]}")
    if problems:
        problems = once_per_layer(problems)
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise PreflightError("the recipe cannot be applied to this model:\n  - " + "\n  - ".join(shown))
    out.tp_sizes = tp_sizes
    out.deploy = deploy_table(config, arch, recipe, is_skipped)
    out.max_position_embeddings = context_length(config)
    out.tied_embeddings = tied_embeddings(meta)
    out.tensor_bytes = estimate_tensor_bytes(meta, set(out.convert), recipe, out.tied_embeddings)
    return out


def mixed_problems(recipe: Recipe, arch: Arch, layers: list[LayerCheck]) -> list[str]:
    """What a `mixed:` block cannot do on this model: its budget below what the coarsest size (where every linear
    starts) stores on these shapes exactly (the recipe check knows no shapes), or a mixture of experts (vLLM's
    fused MoE layer reads one scheme)."""
    m = recipe.mixed
    if m is None:
        return []
    if arch.experts is not None:
        return ["mixed group sizes are not supported for mixtures of experts (vLLM builds each layer's experts as one "
                "fused module with one scheme); remove `mixed:`"]
    fmt, weights = formats.get(recipe.out_format), sum(lc.in_features * lc.out_features for lc in layers)
    start = m.ladder[0]
    stored = sum(fmt.linear_bytes(lc.out_features, lc.in_features, start, recipe.w_bit, recipe.symmetric)
                 for lc in layers)
    low = 8 * stored / weights if weights else 0.0
    if m.budget_bits_per_weight < low:
        where = f"base_group {start}" if start == m.base_group else f"the coarsest size {start}"
        return [f"mixed.budget_bits_per_weight {m.budget_bits_per_weight} is below the {low:.4f} bits per weight "
                f"this model's linears store at {where}; set at least {low:.4f}"
                + ("" if m.coarser else ", or list a coarser size under mixed.coarser")]
    return []


NO_TARGETS = ("no serve.targets: no GPU generation or tensor-parallel size is checked (the table above says what "
              "vLLM would run on each); add serve.targets, e.g. [{compute_capability: 9.0, tensor_parallel_size: 1}], "
              "to refuse one vLLM would refuse or serve on a fallback kernel")


def check_targets(recipe: Recipe, config, arch: Arch, is_skipped) -> None:
    """serve.targets by the hand-written kernel rules, from the config alone: before any weight is read."""
    try:
        targets.check_targets_by_rules(recipe, config, arch, is_skipped)
    except deploy.DeployError as e:
        raise PreflightError(str(e)) from None


def deploy_table(config, arch: Arch, recipe: Recipe, is_skipped) -> dict:
    """The deployability table (vLLM's own kernel choice where vLLM is installed); PreflightError when a
    serve.target is not served on a Marlin-class kernel. A `mixed:` recipe's covers every size it may write: a
    cell is as good as its worst size's."""
    tables = []
    for sized, role in targets.per_size(recipe):
        table, modules = deploy.recipe_table(sized, config, arch, is_skipped)
        problem = targets.target_problem(table, sized, modules, role, recipe.mixed.finer if recipe.mixed else ())
        if problem:
            raise PreflightError(problem)
        tables.append(table)
    return (tables[0] if len(tables) == 1 else deploy.combine(tables)).to_dict()


_LAYER_INDEX = re.compile(r"\.(\d+)(?=[.:])")


def once_per_layer(problems: list[str]) -> list[str]:
    """Messages that differ only in the layer index -> one message each, with the count and the first layers.

    "model.layers.7.mlp.down_proj: in_features 1536 ..." x 30 ->
    "model.layers.*.mlp.down_proj in 30 layers (model.layers.0, .1, .2, ...): in_features 1536 ..."
    """
    groups: dict[str, list[str]] = {}
    for msg in problems:
        groups.setdefault(_LAYER_INDEX.sub(".*", msg, count=1), []).append(msg)
    out = []
    for template, msgs in groups.items():
        if len(msgs) == 1:
            out.append(msgs[0])
            continue
        where, rest = template.split(": ", 1) if ": " in template else (template, "")
        first = [_LAYER_INDEX.search(m).group(1) for m in msgs[:3]]
        more = ", ..." if len(msgs) > 3 else ""
        out.append(f"{where} in {len(msgs)} layers (indices {', '.join(first)}{more}): {rest}")
    return out


def _layer_linears(config, arch: Arch) -> tuple[list[str], list[tuple[str, ...]], set[str]]:
    """A decoder layer's quantizable linears, the sets vLLM loads as one module, the row-parallel ones.

    vLLM's fused MoE module holds every routed expert of a layer: they are converted all or none.
    """
    linears, fused, row = all_linears(arch, config), list(arch.fused), set(arch.row_parallel)
    if arch.experts is not None:
        x = arch.experts
        routed = tuple(n for n in linears if n.startswith(f"{x.module}."))
        fused.append(routed)
        if x.shared:
            fused.append(x.shared_linears()[:2])
        row |= {n for n in linears if n.endswith(".down_proj") and n not in arch.linears}
    return linears, fused, row


def context_length(config) -> int | None:
    """The longest sequence the model was built for (text config's max_position_embeddings), if it says."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def serve_problems(config, recipe: Recipe, tp_sizes: list[int]) -> list[str]:
    """The recipe's `serve:` settings against the model's shapes -> what to change (empty when it serves)."""
    problems = []
    tp = recipe.serve.tensor_parallel_size
    if tp not in tp_sizes:
        problems.append(f"serve.tensor_parallel_size {tp}: some layer's shape does not split into {tp} parts that "
                        f"the group size {recipe.q_group_size} divides; use one of {tp_sizes}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if heads and heads % tp:
        problems.append(f"serve.tensor_parallel_size {tp} does not divide the model's {heads} attention heads "
                        f"(vLLM refuses to split them); use one of {[t for t in tp_sizes if heads % t == 0]}")
    limit, want = context_length(config), recipe.serve.max_model_len
    if want is not None and limit is not None and want > limit:
        problems.append(f"serve.max_model_len {want} exceeds the model's max_position_embeddings {limit}; "
                        f"use {limit} or less (or leave it out)")
    fp8 = fp8_kv_problem(recipe)
    return problems + ([fp8] if fp8 else [])


def fp8_kv_needs_bfloat16(capability: tuple[int, int]) -> bool:
    """A GPU of this compute capability runs an fp8 KV cache only for a bfloat16 model (Hopper: `fp8_kv_problem`)."""
    return capability[0] == 9


def fp8_kv_problem(recipe: Recipe) -> str | None:
    """On Hopper (compute capability 9.0) vLLM's CUDA build runs an fp8 KV cache through FlashAttention 3's FP8
    attention, whose output must be bfloat16: a float16 model with it fails as the engine starts ("For FP8 input,
    output must have dtype BF16", vLLM 0.26 on an H100; docs/BENCHMARKS.md, "The seed's serving table"). Checked
    for a 9.0 serve target, and for this machine's GPU, which the smoke and `serve` run on."""
    kv = recipe.serve.kv_cache_dtype
    if not (kv and kv.startswith("fp8") and recipe.dtype == "float16"):
        return None
    where = [f"serve.targets compute capability {t.capability}" for t in recipe.serve.targets if t.capability == "9.0"]
    if not where and torch.cuda.is_available() and fp8_kv_needs_bfloat16(torch.cuda.get_device_capability(0)):
        where = [f"this machine's {torch.cuda.get_device_name(0)} (compute capability 9.0)"]
    if not where:
        return None
    return (f"serve.kv_cache_dtype {kv} with dtype float16 on {where[0]}: vLLM's FlashAttention 3 there needs a "
            f"bfloat16 model with an fp8 KV cache; use dtype: bfloat16, or leave serve.kv_cache_dtype out")


def tied_embeddings(model) -> bool:
    """lm_head shares the input embedding's parameter (meta-device or loaded model alike)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


def estimate_tensor_bytes(meta, convert: set[str], recipe: Recipe, tied: bool) -> int:
    """Bytes of the tensors the artifact will hold, from shapes alone (a meta-device model).

    A converted linear [out, in] -> packed codes out*in*b/8 + scales n_group*out*2 + zeros n_group*out*b/8
    (+ an index over inputs, GPTQ's g_idx in*4); every other tensor at the recipe dtype (2 bytes); a tied
    lm_head is not written.
    """
    item = torch.empty((), dtype=getattr(torch, recipe.dtype)).element_size()
    bits, g = recipe.w_bit, recipe.mixed.ladder[-1] if recipe.mixed else recipe.q_group_size  # mixed: at most
    index_bytes = formats.get(recipe.out_format).index_bytes_per_input
    total = 0
    for name, t in meta.state_dict().items():
        module = name.removesuffix(".weight")
        if tied and name == "lm_head.weight":
            continue
        if name.endswith(".weight") and module in convert:
            out_f, in_f = t.shape
            groups = 1 if g == -1 else math.ceil(in_f / g)
            total += out_f * in_f * bits // 8 + groups * out_f * (item + math.ceil(bits / 8))
            total += in_f * index_bytes
        else:
            total += t.numel() * (item if t.is_floating_point() else t.element_size())
    return total


def check_free_disk(out: Path, need: int, margin: float = 0.05) -> int:
    """Refuse (PreflightError) when the disk that will hold `out` has less than need * (1 + margin) free.

    The artifact is written next to `out` before it is renamed into place, so an old artifact replaced with
    --force still occupies its space during the write. -> free bytes.
    """
    probe = Path(out).absolute().parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    want = int(need * (1 + margin))
    if free < want:
        raise PreflightError(
            f"not enough free disk for the artifact {out}: it needs about {human_bytes(want)} (estimated from "
            f"the plan: packed weights, scales, zeros and unconverted tensors, +{margin:.0%}) but {probe} has "
            f"{human_bytes(free)} free; free some space on that disk or write elsewhere with --out DIR")
    return free


def pick_device(recipe: Recipe) -> torch.device:
    """The device a run computes on: the recipe's, or for `auto` CUDA when torch sees it, else the CPU."""
    if recipe.device == "cuda" and not torch.cuda.is_available():
        raise PreflightError("recipe asks for device: cuda but no CUDA device is visible; use device: auto or cpu")
    if recipe.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(recipe.device)
