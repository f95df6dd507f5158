"""vLLM's CPU build and 4-bit mixtures of experts: its fused-MoE 4-bit path needs AMX. On a CPU without it the
engine refuses the artifact at start-up, and `quantize preflight` says so before any work."""

import json

import pytest

from eval.vllm_run import VllmError
from quantize import runner
from quantize.preflight.checks import CPU_MOE_REFUSED, LayerCheck, Plan, cpu_moe_refusal
from tests.conftest import build_tiny_model, tiny_recipe
from tests.integration import vllm_load_only


@pytest.fixture(scope="module")
def moe_awq(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-vllm")
    src = build_tiny_model(tmp / "m", "qwen3_moe", hidden=128, intermediate=256)
    recipe = tiny_recipe(tmp, src, name="moe-awq", calibration=dict(dataset="groups-merged", n_samples=4,
                                                                     seq_len=64, seed=0))
    return recipe, runner.run(recipe, out_root=tmp / "a")


def test_preflight_names_the_cpu_refusal(moe_awq):
    recipe, out = moe_awq
    report = runner.preflight_only(str(recipe), out_root=out.parent, force=True)
    assert "mlp.experts.*.gate_proj" in report and "cpu_int4_moe (needs AMX)" in report
    refused = cpu_moe_refusal(_plan_of(out))
    assert (CPU_MOE_REFUSED in report) == (refused is not None)


def _plan_of(out):
    raw = json.loads((out / "preflight.json").read_text())
    return Plan(layers=[LayerCheck(**lc) for lc in raw["layers"]])


@pytest.mark.vllm
@pytest.mark.vllm_load_only
def test_vllm_cpu_refuses_4bit_moe_without_amx(moe_awq):
    _, out = moe_awq
    if cpu_moe_refusal(_plan_of(out)) is None:  # an AMX CPU: the fused-MoE 4-bit path exists, so it must load
        linears = vllm_load_only.load(out)
        assert any("q_proj" in n or "qkv_proj" in n for n in linears)
        return
    with pytest.raises(VllmError, match="No WNA16 MoE backend supports the deployment configuration"):
        vllm_load_only.load(out)
