"""The side process that compiles a CUDA run's Triton kernels while the run starts (`methods.warmup`).

What it compiles must be what the pass launches: the keys the kernels wait on in a real run (a tiny Llama, every
kernel set to triton, under Triton's CPU interpreter) are the keys the plan announces, in the same order. The
process itself runs here under the interpreter on the CPU; whether its launches land on the keys Triton's cache
uses on a GPU is measured on one (docs/BENCHMARKS.md: the first layer's seconds with and without it).
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from quantize import runner
from quantize.methods import warmup
from quantize.errors import UserError
from quantize.methods import gptq_layer, gptq_sweep, launches as launch_plan
from quantize.recipe import load_recipe
from quantize.source.arch import arch_for
from quantize.source.load import config_json
from tests.conftest import ROOT, build_tiny_model, tiny_recipe

pytest.importorskip("triton")

QWEN7B = ROOT / "bench" / "configs" / "qwen2.5-7b"


def _plan(recipes, config_dir=QWEN7B, dtype=torch.float16):
    config = config_json(str(config_dir))
    return launch_plan.plan(recipes, config, arch_for(config), dtype)


def _recipe(tmp_path, name, **over):
    keys = dict(name=name, model=str(QWEN7B), method="awq", w_bit=4, q_group_size=128, zero_point=True,
                version="gemm", dtype="float16")
    keys.update(over)
    (tmp_path / f"{name}.yaml").write_text(json.dumps(keys))
    return load_recipe(str(tmp_path / f"{name}.yaml"))


def test_plan_names_each_kernel_of_the_recipe_once_per_shape(tmp_path):
    awq = load_recipe("qwen7b-awq-g128")
    launches = _plan([awq])
    assert [warmup.key_of(x) for x in launches] == ["awq_fq_triton:128"] * 4 + ["awq_clip_triton:128"] * 2
    assert {(x["rows"], x["cols"]) for x in launches} == {(16, 3584), (16, 18944)}  # 7B: every out a multiple of 16
    assert {x["dtype"] for x in launches} == {"float16"} and [x["delta"] for x in launches[:4]] == [0, 0, 1, 1]
    clip = launches[-1]
    assert (clip["n_grid"], clip["max_shrink"], clip["per_side"]) == (20, 0.5, True)
    # the kernels a recipe leaves to torch are not compiled; AWQ's GPTQ rounding adds the sweep on a static grid
    assert _plan([_recipe(tmp_path, "t", advanced={"awq": {"search_kernel": "torch", "clip_kernel": "torch"}})]) == []
    rounded = _plan([_recipe(tmp_path, "r", awq={"rounding": "gptq"})])
    assert [warmup.key_of(x) for x in rounded][-2:] == ["gptq_triton:128"] * 2 and rounded[-1]["grid"] is True
    gptq = _plan([_recipe(tmp_path, "g", method="gptq", format="gptq", zero_point=False,
                          gptq={"act_order": False})])
    assert {warmup.key_of(x) for x in gptq} == {"gptq_triton:128"}
    assert all(x["grid"] is False and x["spec"]["act_order"] is False and x["spec"]["symmetric"] for x in gptq)
    # the spec the run's own sweep uses (gptq_layer.gptq_spec), rebuilt from JSON in the side process
    assert gptq_sweep.spec_from_json(gptq[0]["spec"]) == \
        gptq_layer.gptq_spec(load_recipe(str(tmp_path / "g.yaml")), torch.float16)
    # q/k/v and gate/up are swept as one problem: their row sums are shapes too (here multiples of 16 as well)
    assert {(x["rows"], x["cols"]) for x in gptq} == {(16, 3584), (16, 18944)}


def test_plan_follows_a_comparison_variant_by_variant(tmp_path):
    variants = [_recipe(tmp_path, f"v{g}", q_group_size=g) for g in (32, 64, 128)]
    keys = list(dict.fromkeys(warmup.key_of(x) for x in _plan(variants)))
    assert keys == ["awq_fq_triton:32", "awq_clip_triton:32", "awq_fq_triton:64", "awq_clip_triton:64",
                    "awq_fq_triton:128", "awq_clip_triton:128"]


def test_rows_keep_the_class_of_out_features(tmp_path):
    """Triton compiles per class of each integer argument (a multiple of 16 or not): out_features 200 -> 16 + 8."""
    model = build_tiny_model(tmp_path / "m", "llama", hidden=128, intermediate=200)
    rows = {(x["rows"], x["cols"]) for x in _plan([_recipe(tmp_path, "s", model=str(model), q_group_size=32)],
                                                   model)}
    assert (24, 128) in rows and (16, 200) in rows  # gate/up: 200 outs of 128 ins; down: 128 outs of 200 ins


def test_only_on_cuda_and_when_allowed(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "m", "llama")
    cpu = load_recipe(str(tiny_recipe(tmp_path, model, name="c", device="cpu")))
    assert runner._warmup_launches([cpu], torch.device("cpu")) == ([], "")
    # a CUDA run with every condition met gets the plan; any condition unmet, none
    cuda = torch.device("cuda")
    monkeypatch.setattr(warmup, "usable", lambda: True)
    launches, device = runner._warmup_launches([cpu], cuda)
    assert device == "cuda" and {warmup.key_of(x) for x in launches} == {"awq_fq_triton:64", "awq_clip_triton:64"}
    monkeypatch.setattr(warmup, "usable", lambda: False)
    assert runner._warmup_launches([cpu], cuda) == ([], "")
    monkeypatch.setattr(warmup, "usable", lambda: True)

    def unreadable(*a):
        raise AssertionError("quantize/source/arch.py: no shapes entry for ['mlp.w3']")
    monkeypatch.setattr(launch_plan, "plan", unreadable)  # whatever goes wrong in planning, the run goes on without it
    assert runner._warmup_launches([cpu], cuda) == ([], "")
    monkeypatch.setattr(warmup, "usable", lambda: True)
    monkeypatch.setenv(warmup.ENV, "off")
    assert runner._warmup_launches([cpu], cuda) == ([], "")
    monkeypatch.setenv(warmup.ENV, "sometimes")
    with pytest.raises(UserError, match="QUANTIZE_TRITON_WARMUP='sometimes' is neither on nor off"):
        runner._warmup_launches([cpu], cuda)


def test_an_unknown_setting_stops_the_run_before_the_model_is_read(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    monkeypatch.setenv(warmup.ENV, "sometimes")
    recipe = tiny_recipe(tmp_path, build_tiny_model(tmp_path / "m", "llama"), name="w")
    assert main(["run", str(recipe), "--out", str(tmp_path / "a"), "--no-eval"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: QUANTIZE_TRITON_WARMUP='sometimes' is neither on nor off: set it to off to run "
                       "without the side process that compiles Triton kernels, or unset it")
    assert not (tmp_path / "a" / "w").exists() and not any(p.name.startswith(".w") for p in (tmp_path / "a").iterdir())


class _FakeNvml:
    """NVML's calls as `warmup.gpus_shared` makes them, over GPUs in the given compute modes."""

    def __init__(self, modes):
        self.modes = modes

    def nvmlInit_v2(self):
        return 0

    def nvmlShutdown(self):
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.modes)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, i, handle):
        handle._obj.value = i + 1
        return 0

    def nvmlDeviceGetComputeMode(self, handle, mode):
        mode._obj.value = self.modes[handle.value - 1]
        return 0


@pytest.mark.parametrize("modes, shared", [([0], True), ([0, 0], True), ([0, 3], False), ([2], False), ([], False)])
def test_no_side_process_where_a_gpu_is_exclusive(monkeypatch, modes, shared):
    """In an exclusive compute mode the side process could take the GPU before the run: no side process then."""
    import ctypes

    monkeypatch.setattr(ctypes, "CDLL", lambda name: _FakeNvml(modes))
    assert warmup.gpus_shared() is shared


def test_the_process_compiles_and_reports_each_key(monkeypatch):
    """The side process, here under the interpreter on the CPU: each key reported ready, a launch that fails
    reported as failed (its key still released), the process's seconds at the end."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = [dict(x, cols=256) for x in _plan([load_recipe("qwen7b-awq-g128")])][::2]
    launches.append({"module": "no_such_kernel", "group": 7, "rows": 16, "cols": 16, "dtype": "float32"})
    w = warmup.Warmup(launches, device="cpu")
    w.start()
    for key in ("awq_fq_triton:128", "awq_clip_triton:128", "no_such_kernel:7"):
        w.wait(key)
        assert w.ready[key].is_set()
    w.stop()  # its last key comes before its seconds: stop() lets a process with every key released finish
    assert w.compiled_s is not None and w.compiled_s > 0
    assert len(w.failed) == 1 and w.failed[0].startswith("no_such_kernel:7 ModuleNotFoundError")


class _Hung(warmup.Warmup):
    def command(self):
        return [sys.executable, "-c", "import time; time.sleep(60)"]


class _SlowLastLine(warmup.Warmup):
    def command(self):
        return [sys.executable, "-c", "import sys, time; sys.stdin.read(); "
                "print('ready awq_fq_triton:64', flush=True); time.sleep(1); print('done 1.5', flush=True)"]


def test_a_process_with_every_key_released_is_let_finish():
    """stop() at the end of a run does not kill a process that has only its last line left to write: the log
    gets its seconds."""
    w = _SlowLastLine([{"module": "awq_fq_triton", "group": 64}])
    w.start()
    w.wait("awq_fq_triton:64")
    w.stop()
    assert w.compiled_s == 1.5 and w.proc.returncode == 0


def test_a_slow_process_is_left_behind(monkeypatch):
    """The run never waits more than WAIT_BUDGET_S in all; then the process is stopped and no key blocks."""
    monkeypatch.setattr(warmup, "WAIT_BUDGET_S", 0.5)
    w = _Hung([{"module": "awq_fq_triton", "group": 64}, {"module": "awq_clip_triton", "group": 64}])
    w.start()
    t0 = time.perf_counter()
    w.wait("awq_fq_triton:64")
    w.wait("awq_clip_triton:64")
    assert time.perf_counter() - t0 < 5 and w.proc.poll() is not None


def _recording_launches(seen: dict, phase: list) -> None:
    """Each Triton kernel's launches recorded as Triton keys its cache: every argument's specialization (its type,
    and for integers 1 / a multiple of 16 / neither, for tensors their alignment) and the constants and options,
    under seen[phase[0]]; then launched as before."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from quantize.methods import awq_clip_triton, awq_fq_triton, gptq_triton

    for module, name in ((awq_fq_triton, "fake_quant_kernel"), (awq_clip_triton, "clip_kernel"),
                         (gptq_triton, "sweep_block")):
        kernel = getattr(module, name)

        class Recorded:
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kwargs):
                    spec = tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)
                    seen[phase[0]].add(json.dumps([name, spec, sorted(kwargs.items())]))
                    return kernel[grid](*args, **kwargs)
                return launch
        setattr(module, name, Recorded())


def waited_keys(tmp: str) -> dict:
    """A tiny Llama quantized with each kernel set to triton (interpreted on the CPU) while a recorder stands in
    for the side process, then the side process's launches for the same recipe run here -> {recipe: (keys the
    kernels waited on, in order, keys the plan announces, the run's launch specializations the side process's
    launches did not make, how many distinct ones the run made)}. k/v have 8 output rows (not a multiple of 16)."""
    from pathlib import Path

    class Recorder:
        def __init__(self):
            self.keys = []

        def wait(self, key):
            if key not in self.keys:
                self.keys.append(key)

    seen, phase = {"run": set(), "warm": set()}, ["run"]
    _recording_launches(seen, phase)
    root = Path(tmp)
    # the interpreter is slow: one small layer; 8 heads of 8 and one KV head make k/v 8 rows
    model = build_tiny_model(root / "m", "llama", hidden=64, intermediate=128, layers=1, heads=8, kv_heads=1)
    triton_only = {"awq": {"search_kernel": "triton", "clip_kernel": "triton"}, "gptq": {"kernel": "triton"}}
    small = {"n_grid": 4, "clip_grid": 4}
    recipes = {"awq": {"awq": small}, "awq-gptq": {"awq": {**small, "rounding": "gptq"}},
               "gptq": {"method": "gptq", "format": "gptq", "zero_point": False}}
    config = config_json(str(model))
    out = {}
    for name, over in recipes.items():
        path = tiny_recipe(root, model, name=name, eval={"enabled": False}, advanced=triton_only,
                           calibration=dict(dataset="groups-merged", n_samples=4, seq_len=32, seed=0), **over)
        recipe = load_recipe(str(path))
        seen["run"].clear(), seen["warm"].clear()
        warmup._ACTIVE = rec = Recorder()
        try:
            phase[0] = "run"
            runner.run(str(path), out_root=root / "a", force=True)
        finally:
            warmup._ACTIVE = None
        launches = launch_plan.plan([recipe], config, arch_for(config), torch.float32)
        phase[0] = "warm"
        warmup.run_launches(launches, "cpu")
        planned = list(dict.fromkeys(warmup.key_of(x) for x in launches))
        out[name] = (rec.keys, planned, sorted(seen["run"] - seen["warm"]), len(seen["run"]))
    return out


def test_the_pass_waits_on_the_keys_the_plan_announces_and_launches_what_it_compiled(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code = ("import json; from tests.unit.test_warmup import waited_keys; "
            f"print(json.dumps(waited_keys({str(tmp_path)!r})))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["awq"][0] == got["awq"][1] == ["awq_fq_triton:64", "awq_clip_triton:64"]
    assert got["awq-gptq"][0] == got["awq-gptq"][1] == ["awq_fq_triton:64", "awq_clip_triton:64", "gptq_triton:64"]
    assert got["gptq"][0] == got["gptq"][1] == ["gptq_triton:64"]
    # and every launch the pass made is one the side process made too: the same cache entries on a GPU
    for name, (_, _, missing, made) in got.items():
        assert made >= 2 and missing == [], (name, made, missing)


def test_a_process_that_cannot_start_leaves_the_run_alone(monkeypatch):
    monkeypatch.setattr(warmup.Warmup, "command", lambda self: ["/nonexistent/python"])
    with warmup.started([{"module": "awq_fq_triton", "group": 64}]) as w:
        assert w is None and warmup._ACTIVE is None
        warmup.wait("awq_fq_triton", 64)  # returns at once
