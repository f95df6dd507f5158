import pytest

from quantize.recipe import Recipe, RecipeError, list_recipes, load_recipe, load_variants
from tests.conftest import write_recipe

BASE = dict(model="some/model", method="awq", w_bit=4, q_group_size=128, zero_point=True, version="gemm")


@pytest.mark.parametrize("name", list_recipes())
def test_every_shipped_recipe_parses(name):
    variants = load_variants(name)
    assert variants and all(v.name.startswith(name) for v in variants)
    if len(variants) == 1:
        assert load_recipe(name).name == name


def test_sweep_expands_validates_and_names_variants(tmp_path):
    write_recipe(tmp_path / "s.yaml", model="m", method="gptq", zero_point=False,
                 sweep={"q_group_size": [32, 128], "gptq.damp_percent": [0.01, 0.1]})
    vs = load_variants(tmp_path / "s.yaml")
    assert [v.name for v in vs] == ["s-g32-damppercent0.01", "s-g32-damppercent0.1", "s-g128-damppercent0.01",
                                    "s-g128-damppercent0.1"]
    assert [(v.q_group_size, v.gptq.damp_percent) for v in vs][1] == (32, 0.1)
    with pytest.raises(RecipeError, match="sweep of 4 variants; run it with `make compare"):
        load_recipe(tmp_path / "s.yaml")


def test_sweep_refuses_bad_variants_before_loading(tmp_path):
    write_recipe(tmp_path / "b.yaml", model="m", method="awq", sweep={"q_group_size": [64, 96, -1]})
    with pytest.raises(RecipeError) as e:
        load_variants(tmp_path / "b.yaml")
    msg = str(e.value)
    assert "variant b-g96" in msg and "q_group_size 96 is not allowed" in msg
    assert "variant b-g-1" in msg and "per channel) is not served in format awq" in msg
    write_recipe(tmp_path / "c.yaml", model="m", method="awq", sweep={"q_group_size": 64})
    with pytest.raises(RecipeError, match="non-empty list"):
        load_variants(tmp_path / "c.yaml")


def test_shipped_recipes_include_the_required_ones():
    names = set(list_recipes())
    assert {"qwen7b-awq-g128", "qwen7b-awq-g64", "qwen7b-awq-g32", "smollm2-awq-g64", "qwen7b-gptq-g128",
            "qwen7b-gptq-g64", "qwen7b-gptq-g32", "smollm2-gptq-g64"} <= names
    seed = load_recipe("qwen7b-awq-g128")
    assert (seed.model, seed.w_bit, seed.q_group_size, seed.zero_point, seed.version) == (
        "Qwen/Qwen2.5-7B-Instruct", 4, 128, True, "gemm")
    assert (seed.calibration.dataset, seed.calibration.n_samples, seed.calibration.seq_len) == ("groups-merged", 128, 512)
    assert load_recipe("qwen7b-awq-g32").q_group_size == 32


def _err(tmp_path, **keys) -> str:
    p = write_recipe(tmp_path / "r.yaml", **{**BASE, **keys})
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    return str(e.value)


def test_unknown_key_names_key_and_allowed(tmp_path):
    msg = _err(tmp_path, w_bits=4)
    assert "`w_bits`" in msg and "unknown key" in msg and "w_bit" in msg


def test_unknown_nested_key(tmp_path):
    msg = _err(tmp_path, calibration={"n_sample": 4})
    assert "calibration.n_sample" in msg and "n_samples" in msg


def test_gemv_refused_with_reason(tmp_path):
    msg = _err(tmp_path, version="gemv")
    assert "version 'gemv'" in msg and "vLLM" in msg and "gemm" in msg


def test_awq_w_bit_3_refused(tmp_path):
    msg = _err(tmp_path, w_bit=3)
    assert "w_bit 3" in msg and "[4]" in msg


def test_bad_group_and_values(tmp_path):
    assert "q_group_size 100" in _err(tmp_path, q_group_size=100)
    assert "calibration.n_samples" in _err(tmp_path, calibration={"n_samples": 0})
    assert "`method`" in _err(tmp_path, method="squeeze")
    assert "`dtype`" in _err(tmp_path, dtype="float32")


def test_name_must_equal_stem(tmp_path):
    p = write_recipe(tmp_path / "r.yaml", **{**BASE, "name": "other"})
    with pytest.raises(RecipeError, match="file stem 'r'"):
        load_recipe(p)


def test_inheritance_merges_nested(tmp_path):
    write_recipe(tmp_path / "parent.yaml", **BASE, calibration={"n_samples": 16, "seq_len": 256})
    child = write_recipe(tmp_path / "child.yaml", base="parent.yaml", q_group_size=64, calibration={"seed": 7})
    r = load_recipe(child)
    assert r.q_group_size == 64 and r.model == "some/model"
    assert (r.calibration.n_samples, r.calibration.seq_len, r.calibration.seed) == (16, 256, 7)


def test_inheritance_cycle(tmp_path):
    write_recipe(tmp_path / "a.yaml", **BASE, base="b.yaml")
    write_recipe(tmp_path / "b.yaml", **BASE, base="a.yaml")
    with pytest.raises(RecipeError, match="loops"):
        load_recipe(tmp_path / "a.yaml")


def test_missing_recipe_suggests_the_nearest_name():
    with pytest.raises(RecipeError, match="did you mean `smollm2-awq-g64`"):
        load_recipe("smollm2-awq-g46")
    with pytest.raises(RecipeError, match="`python -m pipeline list` lists the shipped recipes"):
        load_recipe("does-not-exist")


def test_missing_recipe_file_suggests_the_nearest_file_beside_it(tmp_path):
    write_recipe(tmp_path / "mine-awq-g64.yaml", **BASE)
    with pytest.raises(RecipeError, match="mine-awq-g46.yaml does not exist; did you mean `mine-awq-g64.yaml`"):
        load_recipe(tmp_path / "mine-awq-g46.yaml")


def test_unknown_key_suggests_the_nearest_key(tmp_path):
    assert "`q_grup_size`: unknown key; did you mean `q_group_size`?" in _err(tmp_path, q_grup_size=64)
    assert "`awq.n_gird`: unknown key; did you mean `n_grid`?" in _err(tmp_path, awq={"n_gird": 10})


def test_relative_model_path_resolves_against_the_recipe_files_directory(tmp_path, monkeypatch):
    here = tmp_path / "project" / "recipes"
    (tmp_path / "project" / "models" / "mine").mkdir(parents=True)
    here.mkdir()
    (here / "local" / "m").mkdir(parents=True)
    for name, model in (("dotted", "../models/mine"), ("beside", "local/m"), ("hub", "Owner/model-7b")):
        write_recipe(here / f"{name}.yaml", **{**BASE, "name": name, "model": model})
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    want = str((tmp_path / "project" / "models" / "mine").resolve())
    assert load_recipe(here / "dotted.yaml").model == want
    assert load_recipe(here / "beside.yaml").model == str((here / "local" / "m").resolve())
    assert load_recipe(here / "hub.yaml").model == "Owner/model-7b"  # a hub id stays one
    (here / "child").mkdir()
    no_model = {k: v for k, v in BASE.items() if k != "model"}
    write_recipe(here / "child" / "inherits.yaml", **no_model, name="inherits", base="../dotted.yaml")
    assert load_recipe(here / "child" / "inherits.yaml").model == want  # relative to the file that says it


def test_gptq_asymmetric_in_gptq_format_refused(tmp_path):
    msg = _err(tmp_path, method="gptq", zero_point=True)
    assert "format gptq" in msg and "sym: true" in msg and "compressed-tensors" in msg


def test_gptq_formats_and_bits(tmp_path):
    ok = write_recipe(tmp_path / "ok.yaml", **{**BASE, "method": "gptq", "zero_point": False, "w_bit": 8,
                                               "q_group_size": -1})
    assert load_recipe(ok).out_format == "gptq"
    ct = write_recipe(tmp_path / "ct.yaml", **{**BASE, "method": "gptq", "format": "compressed-tensors"})
    assert load_recipe(ct).out_format == "compressed-tensors"
    assert "w_bit 3" in _err(tmp_path, method="gptq", zero_point=False, w_bit=3)
    assert "q_group_size -1" in _err(tmp_path, q_group_size=-1)  # per-channel not in AWQ GEMM
    assert "w_bit 8" in _err(tmp_path, w_bit=8)  # AWQ GEMM is 4-bit only


def _plan_on_real_config(config: str, recipe: str):
    """The pre-flight plan of a shipped recipe on a real model's config from bench/configs (meta device)."""
    from pathlib import Path

    from quantize.source.arch import arch_for
    from quantize.formats import is_skipped
    from quantize.preflight.checks import plan
    from quantize.source import ModelSource
    from quantize.source.load import read_config

    cfg = read_config(ModelSource("x", Path(__file__).resolve().parents[2] / "bench" / "configs" / config, "dir"))
    return plan(cfg, arch_for(cfg), load_recipe(recipe), is_skipped)


def test_preflight_on_real_shapes():
    """Qwen2.5 shapes (config only, meta device): kernels and the tensor-parallel trap of 72B's 29568."""
    p = _plan_on_real_config("qwen2.5-7b", "qwen7b-gptq-g128")
    assert len(p.convert) == 28 * 7 and {lc.cuda_kernel for lc in p.layers} == {"gptq_marlin"}
    assert p.tp_sizes == [1, 2, 4]  # tp 8: o_proj 3584 / 8 = 448 and down_proj 18944 / 8 = 2368 break g128
    p72 = _plan_on_real_config("qwen2.5-72b", "qwen7b-awq-g128")
    assert p72.tp_sizes == [1]  # down_proj 29568 = 128 x 231: any split leaves a partial group of 128


def test_moe_recipes_plan_every_expert_on_the_real_shape():
    """Qwen3-30B-A3B's config (meta device): the shipped recipes convert attention and all 128 experts' linears in
    each of 48 layers, keep the routers 16-bit, and tensor parallelism stops at 2 (768-wide experts / 4 = 192
    breaks g128)."""
    for name, kernel in (("qwen3-30b-a3b-awq-g128", "awq_marlin"), ("qwen3-30b-a3b-gptq-g128", "gptq_marlin")):
        r = load_recipe(name)
        assert r.dtype == "bfloat16" and r.q_group_size == 128
        p = _plan_on_real_config("qwen3-30b-a3b", name)
        assert len(p.convert) == 48 * (4 + 128 * 3)
        assert not any(n.endswith("mlp.gate") for n in p.convert)
        assert {lc.cuda_kernel for lc in p.layers} == {kernel}
        assert p.tp_sizes == [1, 2]


def test_gptq_kernel_is_an_advanced_option(tmp_path):
    ok = write_recipe(tmp_path / "k.yaml", **{**BASE, "name": "k", "method": "gptq", "zero_point": False,
                                              "advanced": {"gptq": {"kernel": "torch"}}})
    assert load_recipe(ok).advanced.gptq.kernel == "torch"
    plain = load_recipe(write_recipe(tmp_path / "r.yaml", **{**BASE, "method": "gptq", "zero_point": False}))
    assert (plain.advanced.gptq.kernel, plain.advanced.gptq.update) == ("auto", "float32")
    msg = _err(tmp_path, method="gptq", zero_point=False, advanced={"gptq": {"kernel": "cuda"}})
    assert "advanced.gptq.kernel" in msg and "'triton'" in msg


def test_speed_experiments_are_only_under_advanced(tmp_path):
    """The moved keys are refused in their sections, naming what is allowed there; under advanced they load."""
    msg = _err(tmp_path, method="gptq", zero_point=False, gptq={"update": "tf32"})
    assert "`gptq.update`: unknown key" in msg and "block_size" in msg
    assert "`awq.grid_batch`: unknown key" in _err(tmp_path, awq={"grid_batch": 2})
    r = load_recipe(write_recipe(tmp_path / "a.yaml", **{**BASE, "name": "a", "awq": {"screen_keep": None}, "advanced": {
        "awq": {"grid_batch": 2, "coarse_step": 4}, "gptq": {"update": "tf32"}}}))
    assert (r.advanced.awq.grid_batch, r.advanced.awq.coarse_step, r.advanced.gptq.update) == (2, 4, "tf32")
    assert "`advanced.kernel`: unknown key; allowed keys here: awq, gptq" in _err(tmp_path, advanced={"kernel": "torch"})


def test_awq_search_options_defaults_round_trip():
    """The cheaper-search defaults survive to_dict -> Recipe, and the exhaustive search is expressible."""
    r = Recipe(name="x", **BASE)
    assert (r.awq.search_tokens, r.advanced.awq.coarse_step, r.advanced.awq.grid_batch) == (16384, 1, 4)
    assert (r.awq.clip_search, r.awq.refit_iters, r.awq.rounding, r.awq.screen_keep) == ("per_side", 2, "rtn", 7)
    assert Recipe(**r.to_dict()) == r
    exhaustive = Recipe(name="x", **BASE, awq=dict(search_tokens=None, screen_keep=None))
    again = Recipe(**exhaustive.to_dict())
    assert again.awq.search_tokens is None and again.awq.screen_keep is None
    coarse = Recipe(name="x", **BASE, awq=dict(screen_keep=None), advanced=dict(awq=dict(coarse_step=4)))
    assert Recipe(**coarse.to_dict()).advanced.awq.coarse_step == 4


def test_awq_search_group_size(tmp_path):
    """null (the default) searches at q_group_size; a set size is a group size the format could hold."""
    r = Recipe(name="x", **BASE)
    assert r.awq.search_group_size is None and r.awq.search_group(r.q_group_size) == 128
    r = Recipe(name="x", **{**BASE, "q_group_size": 32}, awq=dict(search_group_size=64))
    assert r.awq.search_group(r.q_group_size) == 64 and Recipe(**r.to_dict()) == r
    assert "awq.search_group_size" in _err(tmp_path, awq={"search_group_size": 48})
    assert "awq.search_group_size" in _err(tmp_path, awq={"search_group_size": -1})  # the search scores groups
    msg = _err(tmp_path, q_group_size=-1, format="compressed-tensors")  # a format that takes per-channel codes
    assert "method awq takes q_group_size 32, 64 or 128, not -1 (per channel)" in msg and "method gptq or rtn" in msg


def test_awq_coarse_step_must_be_below_n_grid(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\nmodel: some/model\nmethod: awq\nawq: {n_grid: 8}\nadvanced: {awq: {coarse_step: 8}}\n")
    with pytest.raises(RecipeError, match=r"advanced.awq.coarse_step 8 must be below awq.n_grid 8"):
        load_recipe(p)


def test_awq_screening_and_coarse_to_fine_are_not_combined(tmp_path):
    """Both search part of the grid; the message names both keys and what to set."""
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\nmodel: some/model\nmethod: awq\nadvanced: {awq: {coarse_step: 4}}\n")
    with pytest.raises(RecipeError, match=r"advanced.awq.coarse_step 4 and awq.screen_keep 7 .* set awq.screen_keep: "
                                          r"null to search coarse-to-fine, or coarse_step: 1"):
        load_recipe(p)


# --- hostile YAML ------------------------------------------------------------------------------------------

ALIAS_BOMB = """name: bomb
model: m
method: rtn
a: &a ["xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx"]
""" + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
              f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
              for i in range(9)) + "description: *j\n"


def test_yaml_aliases_refused_without_expanding(tmp_path):
    """9 levels of 9-fold aliases: 7 x 9^9 strings if expanded (tens of GB); refused at the first alias."""
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB)
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "bomb.yaml")
    msg = str(e.value)
    assert "bomb.yaml: line 5: aliases (*name) are not allowed in a recipe" in msg and "\n" not in msg


def test_duplicate_key_names_key_and_lines(tmp_path):
    (tmp_path / "dup.yaml").write_text("name: dup\nmodel: m\nmethod: awq\nq_group_size: 64\nbatch_size: 2\n"
                                       "q_group_size: 128\n")
    with pytest.raises(RecipeError, match=r"dup.yaml: line 6: key 'q_group_size' is given twice in the same mapping "
                                          r"\(first on line 4\); keep one$"):
        load_recipe(tmp_path / "dup.yaml")
    (tmp_path / "dup2.yaml").write_text("name: dup2\nmodel: m\nmethod: awq\ncalibration:\n  n_samples: 4\n"
                                        "  n_samples: 8\n")
    with pytest.raises(RecipeError, match=r"line 6: key 'n_samples' is given twice .*first on line 5"):
        load_recipe(tmp_path / "dup2.yaml")


def test_error_messages_bound_the_values_they_show(tmp_path):
    huge = "x" * 1_000_000
    write_recipe(tmp_path / "big.yaml", model="m", method="awq", q_group_size=huge, batch_size=[huge])
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "big.yaml")
    assert "`q_group_size` = 'xxx" in str(e.value) and len(str(e.value)) < 1000
    write_recipe(tmp_path / "big2.yaml", name=huge, model="m", method="awq")
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "big2.yaml")
    assert "must equal the file stem 'big2'" in str(e.value) and len(str(e.value)) < 1000


def test_recipe_not_utf8_refused(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"name: bin\nmodel: \xff\xfe\x00\n")
    with pytest.raises(RecipeError, match="not UTF-8 text .* save the recipe as UTF-8"):
        load_recipe(tmp_path / "bin.yaml")


def test_awq_rounding_options_validate(tmp_path):
    """clip_search, refit_iters and rounding are recipe keys with checked values."""
    r = Recipe(name="x", **BASE, awq=dict(clip_search="per_side", refit_iters=2, rounding="gptq"))
    assert (r.awq.clip_search, r.awq.refit_iters, r.awq.rounding) == ("per_side", 2, "gptq")
    assert Recipe(**r.to_dict()) == r
    assert "awq.rounding" in _err(tmp_path, method="awq", awq={"rounding": "nearest"})
    assert "awq.refit_iters" in _err(tmp_path, method="awq", awq={"refit_iters": -1})
    assert "awq.clip_search" in _err(tmp_path, method="awq", awq={"clip_search": "asym"})
    # GPTQ rounding reads the gptq section: its block size must fit the groups, as for method gptq
    assert "block_size 96" in _err(tmp_path, method="awq", awq={"rounding": "gptq"}, gptq={"block_size": 96})
    Recipe(name="x", **BASE, gptq=dict(block_size=96))  # unused by round-to-nearest: no error


def test_moe_section_names_its_keys_and_stays_out_of_dense_records(tmp_path):
    write_recipe(tmp_path / "m.yaml", model="m", method="gptq", zero_point=False, moe={"min_tokens": 3})
    with pytest.raises(RecipeError, match=r"moe\.min_tokens.*allowed keys here: min_expert_tokens$"):
        load_recipe(tmp_path / "m.yaml")
    write_recipe(tmp_path / "m.yaml", model="m", method="gptq", zero_point=False, moe={"min_expert_tokens": 3})
    r = load_recipe(tmp_path / "m.yaml")
    assert r.moe_options.min_expert_tokens == 3 and r.to_dict()["moe"] == {"min_expert_tokens": 3}
    write_recipe(tmp_path / "d.yaml", model="m", method="gptq", zero_point=False)
    dense = load_recipe(tmp_path / "d.yaml")
    # unset: the default rule applies, and recipe.yaml (pinned byte for byte for dense models) does not change
    assert dense.moe_options.min_expert_tokens == 128 and "moe" not in dense.to_dict()


def test_base_respelled_through_dotdot_is_a_loop_not_a_long_path(tmp_path):
    """`base: ../d/r.yaml` names the file itself: followed as text it grows until the OS refuses the path."""
    (tmp_path / "d").mkdir()
    write_recipe(tmp_path / "d" / "r.yaml", **BASE, base="../d/r.yaml")
    with pytest.raises(RecipeError, match=r"^recipe inheritance loops: r -> r; remove one of the `base:` keys$"):
        load_recipe(tmp_path / "d" / "r.yaml")


@pytest.mark.parametrize("base", [["parent"], {"name": "parent"}, 3, ""])
def test_base_must_be_one_name(tmp_path, base):
    write_recipe(tmp_path / "parent.yaml", **BASE)
    write_recipe(tmp_path / "c.yaml", base=base, q_group_size=64)
    with pytest.raises(RecipeError, match=r"c.yaml: `base` is .* but must be one recipe name or YAML path"):
        load_recipe(tmp_path / "c.yaml")


def test_base_name_too_long_for_the_os_is_named(tmp_path):
    write_recipe(tmp_path / "c.yaml", base="x" * 5000)
    with pytest.raises(RecipeError, match=r"c.yaml: `base` 'xxx.*\.\.\. cannot be read \(File name too long\); "
                                          r"give it as a recipe name or a short path"):
        load_recipe(tmp_path / "c.yaml")


@pytest.mark.parametrize("size", [float("inf"), "infGB", "1e309GB", "nanGB", "0.1B", "-1GB"])
def test_max_shard_size_must_be_a_finite_positive_size(tmp_path, size):
    write_recipe(tmp_path / "s.yaml", **BASE, max_shard_size=size)
    with pytest.raises(RecipeError, match=r"`max_shard_size`"):
        load_recipe(tmp_path / "s.yaml")
