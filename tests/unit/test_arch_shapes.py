"""The architecture table's linear shapes (`linears.linear_shapes`, read from config.json alone: pre-flight's kernel
checks build no model) against the linears transformers builds from the same config, for every family the table
holds, with and without the keys config.json may leave to transformers' defaults."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from quantize.source import arch as arch_mod
from quantize.source.arch import ARCHITECTURES, arch_for, decoder_layers
from quantize.source.linears import all_linears, linear_shapes
from quantize.source.experts import split_experts
from quantize.source import ModelSource
from quantize.source.load import config_json, read_config

ROOT = Path(__file__).resolve().parents[2]


def meta_linears(config, arch) -> dict[str, tuple[int, int]]:
    """The checker: decoder layer 0 of the model transformers builds on the meta device -> {name: (in, out)}."""
    from transformers import AutoModelForCausalLM

    one = copy.deepcopy(config)
    text = one.get_text_config() if hasattr(one, "get_text_config") else one
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(one)
    split_experts(meta, arch)
    layer = decoder_layers(meta, arch)[0]
    return {n: tuple(int(x) for x in reversed(layer.get_submodule(n).weight.shape))
            for n in all_linears(arch, one) if n not in arch.unquantized}


def family_configs() -> dict[str, object]:
    """name -> transformers config: the tests' tiny model of each family (conftest.TINY, test_architectures.MODELS),
    each again with head_dim left to its config class (it differs from hidden / heads for Qwen3 and Gemma), and
    the shipped recipes' model configs (bench/configs)."""
    import transformers

    from tests.conftest import TINY
    from tests.integration.test_architectures import HEADS, HIDDEN, INTERMEDIATE, MODELS

    specs = {k: (s["cls"], s.get("arch", s["cls"].replace("Config", "ForCausalLM")), s["extra"], 2, 256, 512, 4)
             for k, s in TINY.items()}
    specs |= {k: (cls, a, keys, kv, HIDDEN, INTERMEDIATE, HEADS) for k, (cls, a, keys, kv, _) in MODELS.items()}
    out = {}
    for kind, (cls, arch_name, extra, kv, hidden, inter, heads) in specs.items():
        for variant, keys in (("", extra), ("-class-head-dim", {k: v for k, v in extra.items() if k != "head_dim"})):
            cfg = getattr(transformers, cls)(vocab_size=512, hidden_size=hidden, intermediate_size=inter,
                                             num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                                             pad_token_id=0, bos_token_id=0, eos_token_id=1, **keys)
            cfg.architectures = [arch_name]
            out[f"tiny-{kind}{variant}"] = cfg
    for p in sorted((ROOT / "bench" / "configs").iterdir()):
        if (p / "config.json").is_file():
            out[p.name] = read_config(ModelSource("x", p, "dir"))
    return out


def mismatches(configs: dict[str, object]) -> list[str]:
    """Every linear whose table shape differs from transformers' model, named with its config."""
    bad = []
    for name, cfg in configs.items():
        arch = arch_for(cfg)
        table, meta = linear_shapes(arch, cfg), meta_linears(cfg, arch)
        bad += [f"{name} ({cfg.architectures[0]}) {n}: table {table.get(n)}, transformers {meta.get(n)}"
                for n in sorted(set(table) | set(meta)) if table.get(n) != meta.get(n)]
    return bad


@pytest.fixture(scope="module")
def configs():
    return family_configs()


def test_every_family_is_covered(configs):
    assert {c.architectures[0] for c in configs.values()} == set(ARCHITECTURES)
    for name, a in ARCHITECTURES.items():
        assert [n for n, _, _ in a.shapes] == list(a.linears), name


def test_table_shapes_match_transformers(configs):
    bad = mismatches(configs)
    assert not bad, "\n".join(bad)


def test_a_wrong_table_entry_is_caught(configs, monkeypatch):
    """Negative control: Phi-3's fused gate_up_proj taken as one intermediate wide (not two) is named."""
    phi3 = ARCHITECTURES["Phi3ForCausalLM"]
    wrong = tuple((n, i, "mlp" if n == "mlp.gate_up_proj" else o) for n, i, o in phi3.shapes)
    monkeypatch.setitem(arch_mod.ARCHITECTURES, "Phi3ForCausalLM", replace(phi3, shapes=wrong))
    bad = mismatches({k: v for k, v in configs.items() if v.architectures[0] == "Phi3ForCausalLM"})
    assert bad and all("mlp.gate_up_proj: table (128, 256), transformers (128, 512)" in b for b in bad), bad


def test_config_json_alone_gives_transformers_shapes(configs, tmp_path):
    """config.json read as plain JSON (pre-flight before torch): the same shapes as transformers' config, also
    with head_dim / num_key_value_heads left out; a size the table cannot know without transformers' defaults is
    a KeyError (pre-flight then decides with transformers), never a guess."""
    from transformers import AutoConfig

    checked = set()
    for name, cfg in configs.items():
        for drop in ((), ("head_dim",), ("num_key_value_heads",), ("intermediate_size",)):
            d = tmp_path / f"{name}-{'-'.join(drop) or 'full'}"
            cfg.save_pretrained(d)
            keys = json.loads((d / "config.json").read_text())
            if drop and not any(k in keys for k in drop):
                continue
            (d / "config.json").write_text(json.dumps({k: v for k, v in keys.items() if k not in drop}))
            full = AutoConfig.from_pretrained(d)
            plain = config_json(str(d))
            arch = arch_for(plain)
            try:
                shapes = linear_shapes(arch, plain)
            except KeyError as e:
                assert drop and e.args[0] in drop, (name, drop, e)
                continue
            assert shapes == meta_linears(full, arch), (name, drop)
            checked.add((name, drop))
    assert {(name, ()) for name in configs} <= checked
    # the config classes' own head_dim (Qwen3: 128, Gemma: 256), which the table's head_dim_default states
    assert {(f"tiny-{k}", ("head_dim",)) for k in ("qwen3", "gemma3", "gemma2")} <= checked
