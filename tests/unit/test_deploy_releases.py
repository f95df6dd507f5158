"""The hand-written rules for each vLLM release the project supports (0.26 CUDA, 0.32 CPU), and where they differ.

The rules of the installed release are held to its own answers by test_deploy_agreement.py. The other release's
are held to its answers here when an environment with it is named:

    QUANTIZE_OTHER_VLLM_PYTHON=/path/to/venv/bin/python pytest tests/unit/test_deploy_releases.py

(the interpreter needs vLLM and torch only: the queries are built here and its child imports no project
dependency beyond them).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version

from quantize.formats import is_skipped
from quantize.preflight import deploy, rules
from quantize.preflight.modules import recipe_modules
from quantize.source.arch import arch_for
from quantize.source import ModelSource
from quantize.source.load import read_config

ROOT = Path(__file__).resolve().parents[2]
OTHER = os.environ.get("QUANTIZE_OTHER_VLLM_PYTHON")
V026, V032 = (rules.release_for(v) for v in ("0.26.0", "0.32.0"))
# a fused MoE block Marlin cannot take (hidden size 192 is not a multiple of 128) that the fallback can
EXPERTS = {"name": "mlp.experts", "kind": "experts", "experts": 8, "top_k": 2, "hidden": 192, "intermediate": 256}


def _qwen7b(fmt: str, symmetric: bool, group: int = 128) -> dict:
    cfg = read_config(ModelSource("x", ROOT / "bench" / "configs" / "qwen2.5-7b", "dir"))
    recipe = SimpleNamespace(out_format=fmt, w_bit=4, q_group_size=group, symmetric=symmetric,
                             modules_to_not_convert=("lm_head",))
    return deploy.query(recipe, recipe_modules(recipe, cfg, arch_for(cfg), is_skipped), for_vllm=False)


def test_the_rules_describe_both_supported_releases():
    assert [r.version for r in rules.RELEASES] == [Version("0.26.0"), Version("0.32.0")]
    assert rules.release_for("0.26.0") is V026 and rules.release_for("0.32.0+cpu") is V032
    assert rules.release_for("0.30.1") is V026  # between the two: the closest older release's code
    assert rules.release_for(None) is V032 and rules.release_for("0.20.0") is V032  # unknown: the newest


@pytest.mark.parametrize("release", rules.RELEASES, ids=lambda r: str(r.version))
def test_asymmetric_gptq_is_refused_on_cuda_by_both_releases(release):
    """vLLM's AutoGPTQConfig.TYPE_MAP takes (4, sym) and (8, sym) only, in 0.26 and 0.32 alike: pre-flight refuses
    an asymmetric GPTQ artifact whichever release is installed, and points to compressed-tensors, which serves it."""
    asym = rules.rule_answer(_qwen7b("gptq", symmetric=False), release)
    assert asym["rules_for"] == str(release.version)
    assert asym["cells"] and all("sym=False" in c["refused"] for c in asym["cells"])
    ct = rules.rule_answer(_qwen7b("compressed-tensors", symmetric=False), release)
    cell = next(c for c in ct["cells"] if (c["capability"], c["tp"]) == ("9.0", 1))
    assert not cell["refused"] and {m["kernel"] for m in cell["modules"].values()} == {"Machete"}


def test_the_releases_run_a_moe_block_marlin_cannot_take_on_different_kernels():
    """0.26 hands it to MoeWNA16Config's own Triton kernel; 0.32's MoE oracle picks TritonWNA16Experts. Both are
    fallbacks: the table's verdict is the same, the kernel it names is the release's."""
    q = {"format": "awq", "w_bit": 4, "group": 64, "symmetric": False, "modules": [EXPERTS],
         "capabilities": ["8.0"], "tp_sizes": [1], "dtypes": ["float16"]}
    named = {str(r.version): rules.rule_answer(q, r)["cells"][0]["modules"]["mlp.experts"] for r in rules.RELEASES}
    assert named == {"0.26.0": {"kernel": "MoE WNA16", "tier": deploy.FALLBACK},
                     "0.32.0": {"kernel": "Triton WNA16 MoE", "tier": deploy.FALLBACK}}


def test_the_rules_table_names_its_release():
    table = deploy.build(_qwen7b("gptq", symmetric=True), use_vllm=False)
    assert table.source.startswith(f"the hand-written rules for vLLM {rules.installed_release().version} (")
    assert table.vllm_version is None


@pytest.mark.skipif(not OTHER, reason="QUANTIZE_OTHER_VLLM_PYTHON names no interpreter with another vLLM release")
def test_another_release_agrees_with_its_rules():
    """The child's answers from the named environment's vLLM against the rules for that release: every case of
    test_deploy_agreement.py's queries, the MoE fallback's name, and asymmetric GPTQ's refusal in vLLM's words."""
    from tests.unit.test_deploy_agreement import agreement_queries, check, moe_fallback_names

    queries = agreement_queries()
    answers = [deploy.classify(a) for a in deploy.ask_vllm(queries, python=OTHER)]
    version = answers[0]["vllm_version"]
    assert rules.release_for(version).version.release == Version(version).release, \
        f"vLLM {version} is not a release the rules describe ({[str(r.version) for r in rules.RELEASES]})"
    n, bad = check(queries, answers)
    print(f"\nvLLM {version} at {OTHER}: {n} cases compared with the rules for it; {len(bad)} disagreements")
    assert n > 10_000 and not bad, "\n".join(bad[:20])
    names = moe_fallback_names(queries, answers)
    assert names and all(ours == theirs for ours, theirs in names), names
    gptq_asym = [a for q, a in zip(queries, answers) if q["format"] == "gptq" and not q["symmetric"]]
    assert gptq_asym and all("Unsupported quantization config: bits=4, sym=False" in c["refused"]
                             for a in gptq_asym for c in a["cells"])
