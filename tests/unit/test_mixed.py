"""A budgeted mixed group size: what each format stores per weight, the greedy choice within the budget, one size per
module vLLM fuses, the compressed-tensors config groups, the recipe checks and pre-flight's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from quantize import formats
from quantize.formats import is_skipped
from quantize.methods.job import Job
from quantize.methods.layer import QuantResult
from quantize.mixed import MixedJob, Unit, choose, units_of
from quantize.preflight import deploy, targets
from quantize.preflight.checks import LayerCheck, mixed_problems
from quantize.recipe import Recipe, RecipeError, load_recipe
from quantize.source.arch import ARCHITECTURES, arch_for
from quantize.source.load import ModelSource, read_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ARCHITECTURES["LlamaForCausalLM"]
BASE = dict(name="x", model="m", method="awq", q_group_size=64, format="compressed-tensors")
MIXED = dict(base_group=64, budget_bits_per_weight=4.4125, finer=[32])


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


# ---- the choice ----

def _unit(name: str, bits: dict[int, int], error: dict[int, float]) -> Unit:
    return Unit((name,), bits, error)


def test_greedy_takes_the_largest_error_drop_per_extra_bit_first():
    """b lowers less error than a but for a quarter of the bits: b first; then a does not fit, c (a smaller drop
    per bit) does."""
    units = [_unit("a", {64: 100, 32: 140}, {64: 1.0, 32: 0.6}),  # 0.4 per 40 bits
             _unit("b", {64: 100, 32: 110}, {64: 1.0, 32: 0.8}),  # 0.2 per 10 bits
             _unit("c", {64: 100, 32: 120}, {64: 1.0, 32: 0.9})]  # 0.1 per 20 bits
    assert choose(units, (64, 32), weights=100, budget=3.35) == [64, 32, 32]  # 300 + 10 + 20 <= 335 < 300 + 10 + 40
    assert choose(units, (64, 32), weights=100, budget=3.5) == [32, 32, 64]  # 350: b, then a; c no longer fits
    assert choose(units, (64, 32), weights=100, budget=3.0) == [64, 64, 64]
    assert choose(units, (64, 32), weights=100, budget=9.0) == [32, 32, 32]


def test_budget_is_never_exceeded_and_no_move_without_a_gain():
    g = torch.Generator().manual_seed(0)
    units, weights = [], 0
    for k in range(40):
        size = int(torch.randint(1, 50, (1,), generator=g)) * 64
        weights += size
        err = torch.rand(3, generator=g).sort(descending=True).values.tolist()
        units.append(_unit(str(k), {128: 4 * size + size // 4, 64: 4 * size + size // 2, 32: 5 * size},
                           {128: err[0], 64: err[1], 32: err[2] if k % 7 else err[0] + 1}))
    for budget in (4.26, 4.4, 4.6, 4.9):
        chosen = choose(units, (128, 64, 32), weights, budget)
        assert sum(u.bits[c] for u, c in zip(units, chosen)) <= budget * weights
        assert all(u.error[c] <= u.error[128] for u, c in zip(units, chosen))
        assert all(c != 32 for k, c in enumerate(chosen) if k % 7 == 0)  # g32 made those worse: never taken
    with pytest.raises(ValueError, match="above the budget"):
        choose(units, (128, 64, 32), weights, 4.0)


def test_fused_linears_are_one_unit():
    convert = {f"model.layers.0.{n}" for n in LLAMA.linears} - {"model.layers.0.mlp.down_proj"}
    assert units_of(LLAMA, 0, convert) == [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                           ("mlp.gate_proj", "mlp.up_proj"), ("self_attn.o_proj",)]


def _job(recipe, errors: dict[str, float], shapes: dict[str, tuple[int, int]]) -> Job:
    job = Job(recipe, LLAMA, set(), torch.float16)
    job.errors = {0: dict(errors)}
    job.results = {f"model.layers.0.{n}": QuantResult(torch.zeros(s, dtype=torch.uint8), torch.zeros(1), torch.zeros(1))
                   for n, s in shapes.items()}
    job.overrides = {"model.layers.0.input_layernorm.weight": torch.ones(8)}
    return job


SHAPES = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
          "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
          "mlp.down_proj": (256, 512)}


def _settled(budget: float, e64: dict, e32: dict) -> MixedJob:
    recipe = Recipe(**BASE, mixed={**MIXED, "budget_bits_per_weight": budget})
    convert = {f"model.layers.0.{n}" for n in SHAPES}
    base, finer = _job(recipe, e64, SHAPES), _job(recipe.model_copy(update={"q_group_size": 32}), e32, SHAPES)
    job = MixedJob(recipe, LLAMA, convert, torch.float16, candidates=[finer, base])
    job.settle()
    return job


def test_settle_moves_the_unit_with_the_most_error_lowered_per_bit_and_records_it():
    """v gains most, and q/k/v move together (their summed gain per bit beats down's); then down where the budget
    leaves room for it, else o, a smaller gain that still fits."""
    e64 = {n: 0.1 for n in SHAPES} | {"self_attn.v_proj": 0.5, "mlp.down_proj": 0.3}
    e32 = {n: 0.09 for n in SHAPES} | {"self_attn.v_proj": 0.2, "mlp.down_proj": 0.2}
    qkv = {"self_attn.q_proj": 32, "self_attn.k_proj": 32, "self_attn.v_proj": 32}
    assert _settled(4.42, e64, e32).mixed["groups"]["0"] == {
        **qkv, "mlp.gate_proj": 64, "mlp.up_proj": 64, "self_attn.o_proj": 32, "mlp.down_proj": 64}
    job = _settled(4.46, e64, e32)
    m = job.mixed
    assert m["groups"]["0"] == {**qkv, "mlp.gate_proj": 64, "mlp.up_proj": 64, "self_attn.o_proj": 64,
                                "mlp.down_proj": 32}
    assert m["bits_per_weight"] <= 4.46 and m["linears"] == {"64": 3, "32": 4}
    assert job.errors[0]["self_attn.v_proj"] == 0.2 and job.errors[0]["self_attn.o_proj"] == 0.1
    assert m["errors"]["0"]["mlp.down_proj"] == {"64": 0.3, "32": 0.2}
    assert job.groups["model.layers.0.mlp.down_proj"] == 32 and job.results["model.layers.0.mlp.down_proj"] is \
        job.candidates[0].results["model.layers.0.mlp.down_proj"]


def test_settle_refuses_sizes_that_changed_tensors_outside_the_linears():
    recipe = Recipe(**BASE, mixed=MIXED)
    base, finer = _job(recipe, {}, {}), _job(recipe.model_copy(update={"q_group_size": 32}), {}, {})
    finer.overrides = {k: v * 2 for k, v in base.overrides.items()}
    with pytest.raises(RuntimeError, match="left model.layers.0.input_layernorm.weight different"):
        MixedJob(recipe, LLAMA, set(), torch.float16, candidates=[finer, base]).settle()


def test_awq_candidates_share_the_base_sizes_scale_search():
    from quantize import methods

    r = Recipe(**BASE, mixed=MIXED)
    finer = methods.get("awq").at_group_size(r, 32)
    assert (finer.q_group_size, finer.awq.search_group(32), finer.mixed) == (32, 64, None)
    assert methods.get("gptq").at_group_size(r.model_copy(update={"method": "gptq"}), 32).q_group_size == 32


# ---- what is written ----

def test_compressed_tensors_config_has_one_group_per_size_naming_its_linears():
    ct = formats.COMPRESSED_TENSORS
    r = Recipe(**BASE, mixed=MIXED)
    one = ct.quantization_config(r, [])
    assert [g["targets"] for g in one["config_groups"].values()] == [["Linear"]]
    cfg = ct.quantization_config(r, [], {"m.l.0.q": 32, "m.l.0.o": 64, "m.l.0.k": 32})
    groups = list(cfg["config_groups"].values())
    assert [(g["weights"]["group_size"], g["targets"]) for g in groups] == [(64, ["m.l.0.o"]),
                                                                          (32, ["m.l.0.k", "m.l.0.q"])]
    assert cfg["ignore"] == ["lm_head"]
    with pytest.raises(ValueError, match="holds one group size"):
        formats.AWQ.quantization_config(r, [], {"a": 32, "b": 64})


# ---- recipe checks: before any model loads ----

def _err(tmp_path, base: dict = BASE, **keys) -> str:
    """The recipe error a recipe of `base` + keys gets (test_mixed_coarser.py passes its GPTQ base)."""
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({**base, "name": "r", **keys}))
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    return str(e.value)


@pytest.mark.parametrize("keys,says", [
    ({"mixed": {**MIXED, "budget_bits_per_weight": 4.2}},
     "mixed.budget_bits_per_weight 4.2 is below the 4.3125 bits per weight every linear at base_group 64 stores; "
     "set at least 4.3125"),
    ({"mixed": {**MIXED, "base_group": 128}}, "mixed.base_group 128 differs from q_group_size 64"),
    ({"mixed": {**MIXED, "finer": [64]}}, "mixed.finer [64]: 64 is not finer than base_group 64"),
    ({"mixed": {**MIXED, "finer": [32, 32]}}, "lists a size twice"),
    ({"mixed": {**MIXED, "finer": [16]}}, "mixed.finer.0"),
    ({"mixed": MIXED, "format": "awq"}, "format awq holds one group size per artifact; set format: "
                                        "compressed-tensors"),
    ({"mixed": MIXED, "method": "rtn"}, "method rtn does not measure each linear's output error"),
    ({"mixed": {"base_group": 64, "finer": [32]}}, "mixed.budget_bits_per_weight"),
])
def test_a_bad_mixed_block_is_refused_naming_what_to_change(tmp_path, keys, says):
    assert says in _err(tmp_path, **keys)


def test_the_shipped_mixed_recipe_budgets_g64_plus_a_tenth():
    r = load_recipe("smollm2-mixed-g64-g32")
    ct = formats.COMPRESSED_TENSORS
    assert r.mixed.budget_bits_per_weight == pytest.approx(ct.bits_per_weight(64, 4, False) + 0.10)
    assert "mixed" in r.to_dict() and "mixed" not in load_recipe("smollm2-awq-g64").to_dict()


# ---- pre-flight: shapes and serve.targets ----

def _config(name: str):
    return read_config(ModelSource("x", ROOT / "bench" / "configs" / name, "dir"))


def test_preflight_holds_the_budget_to_the_models_exact_shapes():
    """A budget at the large-linear limit passes the recipe check; the per-linear weight_shape tensors put the
    real shapes above it."""
    r = Recipe(**BASE, mixed={**MIXED, "budget_bits_per_weight": 4.3125})
    layers = [LayerCheck("q", 576, 192, "", "")]
    (msg,) = mixed_problems(r, LLAMA, layers)
    assert "is below the 4.3137 bits per weight this model's linears store at base_group 64" in msg
    assert mixed_problems(r.model_copy(update={"mixed": r.mixed.model_copy(
        update={"budget_bits_per_weight": 4.314})}), LLAMA, layers) == []
    moe = arch_for(_config("qwen3-30b-a3b"))
    assert "not supported for mixtures of experts" in mixed_problems(r, moe, layers)[0]


def test_every_size_of_a_mix_is_checked_against_serve_targets(tmp_path):
    """7B on 4 Hoppers serves g64 and g32 on Marlin-class kernels; the 72B trap (29568 / 4 not a multiple of 128)
    refuses a g128 base, naming the base size's fix."""
    target = {"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 4}]}
    ok = Recipe(**{**BASE, "model": "qwen"}, mixed=MIXED, serve=target)
    cfg = _config("qwen2.5-7b")
    targets.check_targets_by_rules(ok, cfg, arch_for(cfg), is_skipped)
    trap = Recipe(**{**BASE, "q_group_size": 128}, mixed={**MIXED, "base_group": 128, "finer": [64, 32],
                                                          "budget_bits_per_weight": 4.3}, serve=target)
    cfg72 = _config("qwen2.5-72b")
    with pytest.raises(deploy.DeployError) as e:
        targets.check_targets_by_rules(trap, cfg72, arch_for(cfg72), is_skipped)
    msg = str(e.value)
    assert "\n" not in msg and "mixed group size 128: compute capability 9.0 at tensor_parallel_size 4" in msg
    # 32 is the only size these shapes divide into and nothing is finer: the fix is no mix, not a base of 32
    assert msg.endswith("fix: set tensor_parallel_size: 1 in this target or remove mixed: and set q_group_size: 32")
    assert targets._base_fix("q_group_size: 64 or q_group_size: 32 or tensor_parallel_size: 2 in this target",
                             (64, 32)) == ("set q_group_size and mixed.base_group: 64 with mixed.finer [32] or "
                                           "tensor_parallel_size: 2 in this target or remove mixed: and set "
                                           "q_group_size: 32")


def test_the_deployability_table_of_a_mix_is_its_worst_size_per_cell():
    cfg = _config("qwen2.5-7b")
    r = Recipe(**BASE, mixed=MIXED)
    tables = [deploy.recipe_table(sized, cfg, arch_for(cfg), is_skipped, use_vllm=False)[0]
              for sized, _ in targets.per_size(r)]
    both = deploy.combine(tables)
    cell = both.cell("9.0", 1, "float16")
    assert cell.verdict == deploy.MARLIN and "Machete" in cell.slowest and "Marlin" in cell.slowest
    assert cell.kernels["mlp.gate_up_proj"] == "g64: Machete, g32: Marlin"
    assert "groups 64, 32 (mixed)" in deploy.render(both)
    refused = deploy.combine([tables[0], deploy.Table(**{**tables[1].to_dict(), "cells": [
        deploy.Cell(c.capability, c.tp, c.dtype, deploy.REFUSED, {}, "refused (x)", "why") for c in tables[1].cells]})])
    assert refused.cell("9.0", 1, "float16").verdict == deploy.REFUSED
    assert refused.cell("9.0", 1, "float16").reason == "why"
