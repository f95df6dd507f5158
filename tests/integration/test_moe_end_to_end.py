"""Tiny random mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: 4 experts, top-2) quantized end to end on the
CPU with AWQ and GPTQ into every 4-bit format vLLM serves for MoE, read back by our own reader and compared with
transformers' fused experts on the same dequantized weights."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from eval.artifact import empty_model, load_dequantized
from quantize import runner
from quantize.methods import awq_grid, awq_search as awq, gptq_hessian
from quantize.export import card_plots
from quantize.source.arch import arch_for, checkpoint_name, get_module
from quantize.source.linears import all_linears
from quantize.capture.forward import first_layer_inputs
from quantize.capture.loop import LayerData
from quantize.methods.job import Job
from quantize.methods.awq_layer import norm_consumers
from quantize.methods.layer import expert_tokens
from quantize.recipe import load_recipe
from quantize.source.experts import ExpertList, split_experts
from quantize.files import sha256_file
from tests.conftest import build_tiny_model, heldout_ids, kl_divergence, tiny_recipe

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
# method, format: AutoAWQ GEMM, GPTQ (symmetric: vLLM's only GPTQ) and compressed-tensors (asymmetric) for each
VARIANTS = {
    "awq-gemm": dict(method="awq"),
    "awq-ct": dict(method="awq", format="compressed-tensors"),
    "gptq": dict(method="gptq", zero_point=False),
    "gptq-ct-asym": dict(method="gptq", zero_point=True, format="compressed-tensors"),
}
CALIB = dict(dataset="groups-merged", n_samples=8, seq_len=64, seed=0)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    return {k: build_tiny_model(tmp_path_factory.mktemp(k), k, hidden=128, intermediate=256) for k in KINDS}


@pytest.fixture(scope="module")
def artifacts(moe_models, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("moe-runs")
    return {(k, v): runner.run(tiny_recipe(tmp, moe_models[k], name=f"{k}-{v}", calibration=CALIB,
                                           compute_dtype="float32", **over), out_root=tmp / "a")
            for k in KINDS for v, over in VARIANTS.items()}


def _fused_twin(split_model) -> torch.nn.Module:
    """transformers' own model (fused experts) holding the split model's weights."""
    config = split_model.config
    twin = empty_model(config, torch.float32, "cpu")
    arch = arch_for(config)
    own = {n: t for n, t in split_model.state_dict().items() if f".{arch.experts.module}." not in f".{n}"}
    missing, unexpected = twin.load_state_dict(own, strict=False)
    assert not unexpected and all(".experts." in m for m in missing)
    with torch.no_grad():
        for mine, theirs in zip(split_model.model.layers, twin.model.layers):
            experts, fused = get_module(mine, arch.experts.module), get_module(theirs, arch.experts.module)
            for e, x in enumerate(experts):
                fused.gate_up_proj[e].copy_(torch.cat([x.gate_proj.weight, x.up_proj.weight]))
                fused.down_proj[e].copy_(x.down_proj.weight)
    return twin.eval()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_reader_matches_transformers_and_the_source(artifacts, moe_models, kind, variant):
    out = artifacts[(kind, variant)]
    ours = load_dequantized(out)
    assert isinstance(ours.model.layers[0].mlp.experts, ExpertList)
    ids = heldout_ids(moe_models[kind], n=2, seq=48)
    with torch.no_grad():
        a, b = ours(ids).logits, _fused_twin(ours)(ids).logits
    assert torch.isfinite(a).all()
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    source = AutoModelForCausalLM.from_pretrained(moe_models[kind], dtype=torch.float32).eval()
    kl = kl_divergence(source, ours, ids)
    assert 0 < kl < 0.2, kl  # 4-bit: close to the source (damaged experts give > 1), never identical


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_artifact_tensors_and_token_counts(artifacts, kind, variant, tmp_path):
    out = artifacts[(kind, variant)]
    config = AutoConfig.from_pretrained(out)
    arch = arch_for(config)
    n_exp, top_k = getattr(config, arch.experts.count_key), getattr(config, arch.experts.top_k_key)
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        keys = set(st.keys())
        for name in keys:
            t = st.get_tensor(name)
            assert not t.is_floating_point() or torch.isfinite(t).all(), name
        for i in range(config.num_hidden_layers):
            for n in arch.experts.unconverted():  # the router (and shared-expert gate): 16-bit, never packed
                full = checkpoint_name(arch, f"model.layers.{i}.{n}")
                assert st.get_tensor(f"{full}.weight").dtype == torch.float16
                assert not any(k.startswith(f"{full}.") and not k.endswith(".weight") for k in keys)
            for e in range(n_exp):
                for lin in arch.experts.linears:
                    full = checkpoint_name(arch, f"model.layers.{i}.{arch.experts.expert(e, lin)}.weight")
                    full = full.removesuffix(".weight")
                    assert f"{full}.weight" not in keys and any(k.startswith(f"{full}.") for k in keys), full
    m = json.loads((out / "manifest.json").read_text())
    stats = m[f"{VARIANTS[variant]['method']}_stats"]
    for i in range(config.num_hidden_layers):
        rec = stats[str(i)]["experts"]
        assert rec["tokens"] == CALIB["n_samples"] * CALIB["seq_len"]
        assert len(rec["routed_tokens"]) == n_exp and sum(rec["routed_tokens"]) == rec["tokens"] * top_k
        assert rec["calibrated_on_all_tokens"] == [e for e, c in enumerate(rec["routed_tokens"])
                                                   if c < rec["min_expert_tokens"]]
        counts = sorted(rec["routed_tokens"])  # the model card's row for the layer shows the same counts
        assert f"\n| {i} | {n_exp} | {counts[0]} | {counts[n_exp // 2]} | {counts[-1]} | " in \
            (out / "README.md").read_text()
    # the heatmap next to the table is the manifest's counts drawn, listed (and hashed) with the other files
    assert m["expert_plot"] == "experts.png" and "](experts.png)" in (out / "README.md").read_text()
    assert m["files"]["experts.png"]["sha256"] == sha256_file(out / "experts.png")
    assert card_plots.plot_experts(m, tmp_path / "again.png") is not None
    assert (tmp_path / "again.png").read_bytes() == (out / "experts.png").read_bytes()


def _scaled_logits(model_dir, ids, leave_out: str | None = None):
    """float64 logits before and after a random scale is folded into every MoE block's norm and the modules it
    feeds (less `leave_out`)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    arch = arch_for(model.config)
    split_experts(model, arch)  # transformers' fused experts have no float64 kernel
    with torch.no_grad():
        before = model(ids).logits
        torch.manual_seed(1)
        for layer in model.model.layers:
            s = torch.rand(model.config.hidden_size, dtype=torch.float64) * 4 + 0.25
            awq.apply_scales(get_module(layer, arch.experts.norm),
                             [layer.get_submodule(n) for n in norm_consumers(layer, arch) if n != leave_out], s)
        return before, model(ids).logits


@pytest.mark.parametrize("kind", KINDS)
def test_awq_norm_scale_folds_exactly_in_float64(moe_models, kind):
    """The norm feeding the experts divided by s, every module it feeds (experts, shared expert, router,
    shared-expert gate) multiplied by s: the float64 model computes what the unscaled one does, to rounding
    (the routers take their softmax in float32: that rounding is float32's)."""
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    before, after = _scaled_logits(moe_models[kind], ids)
    assert (after - before).abs().max() < 1e-5
    before, unscaled_router = _scaled_logits(moe_models[kind], ids, leave_out="mlp.gate")
    assert (unscaled_router - before).abs().max() > 1e-2  # the check sees a consumer left out


def test_expert_tokens_rule():
    top_k = torch.tensor([[0, 1], [1, 2], [0, 1], [1, 0]])  # [T=4, k=2]: expert 3 gets nothing, 2 gets one token
    counts, rows = expert_tokens(top_k, 4, min_tokens=2)
    assert counts == [3, 4, 1, 0]
    assert rows[0].tolist() == [0, 2, 3] and rows[1].tolist() == [0, 1, 2, 3]
    assert rows[2] is None and rows[3] is None  # below the threshold: every token
    _, rows = expert_tokens(top_k, 4, min_tokens=0)
    assert rows[2].tolist() == [1] and rows[3] is None  # an expert with no token is never left without inputs


class _NeverPicks(torch.nn.Module):
    """A top-k router that never sends a token to expert `never` (its logit is -inf)."""

    def __init__(self, router: torch.nn.Module, never: int):
        super().__init__()
        self.weight, self.top_k, self.never = router.weight, router.top_k, never

    def forward(self, x):
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), self.weight)  # [T, E]
        logits[:, self.never] = float("-inf")
        weights, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), index


def test_an_expert_the_router_never_picks_is_calibrated_on_every_token(moe_models, tmp_path):
    """GPTQ on an expert with no routed token would write zeros; the min-token rule calibrates it on every token."""
    src = moe_models["qwen3_moe"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    arch = arch_for(model.config)
    split_experts(model, arch)
    layer = model.model.layers[0]
    layer.mlp.gate = _NeverPicks(layer.mlp.gate, never=3)
    recipe = load_recipe(tiny_recipe(tmp_path, src, name="starved", method="gptq", zero_point=False))
    samples = heldout_ids(src, n=4, seq=64)
    inputs, kwargs = first_layer_inputs(model, arch, samples, torch.device("cpu"), torch.float32, 4)
    convert = {f"model.layers.0.{n}" for n in all_linears(arch, model.config)}
    fp = {n: layer.get_submodule(n).weight.detach().clone() for n in ("mlp.experts.0.up_proj", "mlp.experts.3.up_proj",
                                                                       "mlp.experts.3.down_proj")}
    job = Job(recipe, arch, convert, torch.float16)
    job.process(LayerData(0, layer, inputs, kwargs[0]))
    rec = job.stats[0]["experts"]
    assert rec["routed_tokens"][3] == 0 and 3 in rec["calibrated_on_all_tokens"]
    for name, w in fp.items():
        q = layer.get_submodule(name).weight  # the dequantized result
        assert f"model.layers.0.{name}" in job.results
        assert ((q - w).norm() / w.norm()) < 0.2, name  # 4-bit rounding, not zeros


class _Peak:
    """Peak bytes of the tracked tensors (Hessians, Gram matrices) alive at once."""

    def __init__(self):
        self.alive, self.peak = weakref.WeakSet(), 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        self.alive.add(t)
        self.peak = max(self.peak, sum(x.numel() * x.element_size() for x in self.alive))
        return t


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_64_experts_hold_one_experts_statistics_at_a_time(tmp_path, monkeypatch, method):
    """64 experts: the Hessians / Gram matrices alive at once stay those of about one expert, not 64."""
    hidden = 64
    src = build_tiny_model(tmp_path / "m", "qwen3_moe", hidden=hidden, intermediate=128, layers=1, heads=2,
                           kv_heads=1, extra={"num_experts": 64, "moe_intermediate_size": 64, "head_dim": 32})
    peak = _Peak()

    class Tracked(gptq_hessian.HessianAccumulator):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            peak.track(self._H)

    grams = awq_grid.group_gram
    monkeypatch.setattr(gptq_hessian, "HessianAccumulator", Tracked)
    monkeypatch.setattr(awq_grid, "group_gram", lambda *a, **k: peak.track(grams(*a, **k)))
    over = dict(awq=dict(n_grid=4, clip_grid=4, rounding="gptq")) if method == "awq" else dict(zero_point=False)
    out = runner.run(tiny_recipe(tmp_path, src, name=f"e64-{method}", method=method, q_group_size=32,
                                 calibration=CALIB, compute_dtype="float32", moe=dict(min_expert_tokens=1), **over),
                     out_root=tmp_path / "a")
    rec = json.loads((out / "manifest.json").read_text())[f"{method}_stats"]["0"]["experts"]
    assert len(rec["routed_tokens"]) == 64 and rec["calibrated_on_all_tokens"] == \
        [e for e, c in enumerate(rec["routed_tokens"]) if c == 0]
    one_expert = hidden * hidden * 4  # one float32 [H, H] Hessian (gate/up); down's is the same size here
    # all experts' at once would be 64 of them; the dense attention's two stages overlap by one
    assert 0 < peak.peak <= 3 * one_expert, peak.peak / one_expert


@pytest.mark.parametrize("kind,over", [
    ("qwen2_moe", dict(method="awq", compute_dtype="bfloat16", dtype="bfloat16")),  # the GPU's compute dtype
    ("mixtral", dict(method="rtn")),
])
def test_bfloat16_compute_and_round_to_nearest(moe_models, tmp_path, kind, over):
    out = runner.run(tiny_recipe(tmp_path, moe_models[kind], name=f"{kind}-{over['method']}", calibration=CALIB,
                                 **over), out_root=tmp_path / "a")
    ours = load_dequantized(out)
    ids = heldout_ids(moe_models[kind], n=2, seq=48)
    source = AutoModelForCausalLM.from_pretrained(moe_models[kind], dtype=torch.float32).eval()
    assert 0 < kl_divergence(source, ours, ids) < 0.2
    m = json.loads((out / "manifest.json").read_text())
    assert m["quantized_modules"] == 2 * (4 + 3 * 4 + (3 if kind == "qwen2_moe" else 0))
