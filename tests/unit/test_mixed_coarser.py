"""A mix with sizes coarser than its base (`mixed.coarser`, -1 = per channel): every linear starts at the coarsest
size, so a budget below the base size's bits buys the finer sizes where they pay most; the recipe check, pre-flight
and the records name the coarser sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quantize.formats import is_skipped
from quantize.mixed import Unit, choose
from quantize.preflight import deploy, targets
from quantize.preflight.checks import LayerCheck, mixed_problems
from quantize.records import Manifest
from quantize.records.manifest_json import Mixed
from quantize.recipe import Recipe, RecipeError, load_recipe
from quantize.source.arch import ARCHITECTURES, arch_for
from quantize.source.load import ModelSource, read_config
from tests.unit.test_mixed import _err as recipe_error

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ARCHITECTURES["LlamaForCausalLM"]
BASE = dict(name="x", model="m", method="gptq", q_group_size=64, format="compressed-tensors")
MIXED = dict(base_group=64, budget_bits_per_weight=4.2, finer=[32], coarser=[-1])


def _unit(name: str, error: dict[int, float]) -> Unit:
    return Unit((name,), {-1: 100, 64: 130, 32: 160}, error)


UNITS = [_unit("a", {-1: 3.0, 64: 1.0, 32: 0.9}),  # -1 -> 64: 2.0 per 30 bits; then 64 -> 32: 0.1 per 30
         _unit("b", {-1: 1.5, 64: 1.0, 32: 0.4}),  # -1 -> 64: 0.5 per 30; -1 -> 32: 1.1 per 60 (more per bit)
         _unit("c", {-1: 1.2, 64: 1.1, 32: 1.0})]  # 0.1 per 30, 0.2 per 60


def test_every_unit_starts_at_the_coarsest_size_and_the_budget_buys_the_best_drops_per_bit():
    ladder = (-1, 64, 32)
    assert choose(UNITS, ladder, weights=100, budget=3.0) == [-1, -1, -1]  # 300 bits: nothing to spend
    assert choose(UNITS, ladder, weights=100, budget=3.3) == [64, -1, -1]  # a first: the largest drop per bit
    # 360: after a (330), b's jump to 32 (60 bits) no longer fits; its step to 64 does
    assert choose(UNITS, ladder, weights=100, budget=3.6) == [64, 64, -1]
    # 390: after a, b jumps straight to 32 (1.1 per 60 beats 0.5 per 30); nothing else fits
    assert choose(UNITS, ladder, weights=100, budget=3.9) == [64, 32, -1]
    with pytest.raises(ValueError, match="coarsest size alone stores 3.0000 bits per weight, above the budget 2.9"):
        choose(UNITS, ladder, weights=100, budget=2.9)


def test_the_ladder_runs_from_the_coarsest_size_to_the_finest():
    m = Recipe(**BASE, mixed={**MIXED, "coarser": [128, -1]}).mixed
    assert m.coarser == (-1, 128) and m.ladder == (-1, 128, 64, 32) and m.sizes == (64, 32, -1, 128)
    assert Recipe(**BASE, mixed={**MIXED, "budget_bits_per_weight": 4.4, "coarser": []}).mixed.ladder == (64, 32)


def _err(tmp_path, **keys) -> str:
    return recipe_error(tmp_path, BASE, **keys)


@pytest.mark.parametrize("keys,says", [
    ({"mixed": {**MIXED, "coarser": [64]}},
     "mixed.coarser [64]: 64 is not coarser than base_group 64; list sizes above it (128, -1; -1 = per channel)"),
    ({"mixed": {**MIXED, "coarser": [-1, -1]}}, "mixed.coarser [-1, -1] lists a size twice"),
    ({"mixed": {**MIXED, "coarser": [32]}}, "mixed.coarser.0"),
    ({"mixed": MIXED, "method": "awq"},
     "mixed.coarser -1: method awq takes q_group_size 32, 64 or 128, not -1 (per channel)"),
    ({"mixed": {**MIXED, "coarser": [128], "budget_bits_per_weight": 4.1}},
     "mixed.budget_bits_per_weight 4.1 is below the 4.1562 bits per weight every linear at the coarsest size 128 "
     "stores; set at least 4.1562 (g32 everywhere stores 4.6250)"),
    ({"mixed": {**MIXED, "coarser": [], "budget_bits_per_weight": 4.2}},
     "every linear at base_group 64 stores; set at least 4.3125 (g32 everywhere stores 4.6250), or list a coarser "
     "size under mixed.coarser"),
])
def test_a_bad_coarser_size_or_budget_is_refused_naming_what_to_change(tmp_path, keys, says):
    assert says in _err(tmp_path, **keys)


def test_a_budget_below_the_base_sizes_bits_loads_with_a_coarser_size(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({**BASE, "name": "r", "mixed": MIXED}))
    r = load_recipe(p)
    assert r.mixed.ladder == (-1, 64, 32) and r.to_dict()["mixed"]["coarser"] == [-1]


def test_the_shipped_channel_mix_budgets_g128_plus_a_tenth():
    from quantize import formats

    r = load_recipe("smollm2-gptq-mixed-g64-g32-channel")
    ct = formats.COMPRESSED_TENSORS
    assert r.mixed.budget_bits_per_weight == pytest.approx(ct.bits_per_weight(128, 4, False) + 0.10)
    assert r.mixed.budget_bits_per_weight < ct.bits_per_weight(64, 4, False)  # below g64: the mix must save bits
    assert r.mixed.ladder == (-1, 64, 32)


def test_preflight_holds_the_budget_to_the_coarsest_sizes_exact_shapes():
    """Per channel on [192, 576]: codes 55,296 bytes, one scale per row 384, zero points 96, weight_shape 16:
    55,792 bytes, 4.0359 bits per weight."""
    r = Recipe(**BASE, mixed={**MIXED, "budget_bits_per_weight": 4.03})
    layers = [LayerCheck("q", 576, 192, "", "")]
    (msg,) = mixed_problems(r, LLAMA, layers)
    assert msg == ("mixed.budget_bits_per_weight 4.03 is below the 4.0359 bits per weight this model's linears store "
                   "at the coarsest size -1; set at least 4.0359")
    assert mixed_problems(r.model_copy(update={"mixed": r.mixed.model_copy(
        update={"budget_bits_per_weight": 4.036})}), LLAMA, layers) == []


def _config(name: str):
    return read_config(ModelSource("x", ROOT / "bench" / "configs" / name, "dir"))


def test_a_coarser_size_that_a_serve_target_refuses_is_named_for_removal():
    """72B at tensor-parallel size 2: 29568 / 2 = 14784 divides by 64 and 32 but not by 128, so a mix that may
    write g128 is refused at that size, and the fix is to drop it from mixed.coarser."""
    target = {"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 2}]}
    cfg = _config("qwen2.5-72b")
    ok = Recipe(**{**BASE, "model": "qwen"}, mixed={**MIXED, "coarser": [], "budget_bits_per_weight": 4.4},
                serve=target)
    targets.check_targets_by_rules(ok, cfg, arch_for(cfg), is_skipped)
    trap = ok.model_copy(update={"mixed": ok.mixed.model_copy(update={"coarser": (128,)})})
    with pytest.raises(deploy.DeployError) as e:
        targets.check_targets_by_rules(trap, cfg, arch_for(cfg), is_skipped)
    msg = str(e.value)
    assert "\n" not in msg and "mixed group size 128: compute capability 9.0 at tensor_parallel_size 2" in msg
    assert msg.endswith("fix: remove 128 from mixed.coarser")
    assert [role for _, role in targets.per_size(trap)] == ["base", "finer", "coarser"]


def _manifest(coarser: list[int] | None, linears: dict[str, int]) -> Manifest:
    mixed = {"base_group": 64, "finer": [32], "budget_bits_per_weight": 4.2, "bits_per_weight": 4.19,
             "bits_per_weight_at": {}, "weights": 1, "linears": linears, "error_sum": {}, "objective": "",
             "groups": {}, "errors": {}}
    if coarser is not None:
        mixed["coarser"] = coarser
    return Manifest.model_construct(mixed=Mixed.of(mixed))


def test_the_group_text_names_per_channel_and_reads_a_record_without_coarser():
    assert _manifest([-1], {"64": 3, "32": 2, "-1": 4}).group_text() == "64+32+channel"
    assert _manifest([-1], {"64": 3, "32": 0, "-1": 4}).group_text() == "64+channel"
    assert _manifest(None, {"64": 3, "32": 2}).group_text() == "64+32"  # written before coarser sizes existed
