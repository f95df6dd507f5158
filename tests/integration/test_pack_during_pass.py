"""Packing each layer while the pass goes on (`formats.pack.Packer`) writes the bytes export's own packing writes."""

import json

import pytest
import torch

from quantize import runner
from quantize.formats.pack import Packer, pack_all
from quantize.methods.layer import QuantResult
from quantize.recipe import load_recipe
from tests.conftest import tiny_recipe


def _weights(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    return {f: r["sha256"] for f, r in m["files"].items() if f.endswith(".safetensors")}


def test_a_run_packing_during_the_pass_writes_the_same_artifact(tiny_qwen2, tmp_path, monkeypatch):
    """AWQ, GPTQ (compressed-tensors) and RTN in one shared pass, once packed at export and once by a worker per
    layer (enabled on the CPU here; runs enable it on CUDA): every weight file is the same."""
    recipes = [tiny_recipe(tmp_path, tiny_qwen2, name="p-awq"),
               tiny_recipe(tmp_path, tiny_qwen2, name="p-gptq", method="gptq", format="compressed-tensors"),
               tiny_recipe(tmp_path, tiny_qwen2, name="p-rtn", method="rtn")]
    monkeypatch.setattr(runner, "PACK_DURING_PASS", set())
    at_export = runner.run_many([load_recipe(r) for r in recipes], tmp_path / "at-export")
    submitted = []
    real = Packer.submit
    monkeypatch.setattr(Packer, "submit", lambda self, results: submitted.append(sorted(results))
                        or real(self, results))
    monkeypatch.setattr(runner, "PACK_DURING_PASS", {"cpu"})
    during = runner.run_many([load_recipe(r) for r in recipes], tmp_path / "during")
    for a, b in zip(at_export, during):
        assert _weights(a) == _weights(b) and _weights(a), a.name
    # one submission per job per layer (2 layers), each holding that layer's converted linears only
    assert len(submitted) == 3 * 2
    for names in submitted:
        layer = {n.split(".")[2] for n in names}
        assert len(layer) == 1 and len(names) == 7, names


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_packer_gives_pack_alls_tensors(fmt, tmp_path, tiny_llama):
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_llama, name=f"k-{fmt}", format=fmt,
                                     **{"awq": {}, "gptq": {"method": "gptq", "zero_point": False},
                                        "compressed-tensors": {"method": "gptq"}}[fmt]))
    g = torch.Generator().manual_seed(0)
    results = {f"m{i}": QuantResult(torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=g),
                                    torch.rand(64, 2, generator=g, dtype=torch.float32) + 0.1,
                                    torch.randint(0, 16, (64, 2), dtype=torch.int32, generator=g))
               for i in range(3)}
    packer = Packer(recipe, torch.float16, torch.device("cpu"))
    packer.submit({k: results[k] for k in ("m0", "m1")})
    packer.submit({"m2": results["m2"]})
    ready = packer.packed()
    assert sorted(ready) == ["m0", "m1", "m2"]
    want, _ = pack_all(results, recipe, [], torch.float16)
    got, _ = pack_all(results, recipe, [], torch.float16, ready=ready)
    for m in results:
        assert got[m] is ready[m]
        assert want[m].keys() == got[m].keys()
        for k in want[m]:
            assert want[m][k].dtype == got[m][k].dtype and torch.equal(want[m][k], got[m][k]), (m, k)


def test_a_packing_error_is_raised_at_export_and_the_worker_stops(tmp_path, tiny_llama):
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_llama, name="k-bad"))
    packer = Packer(recipe, torch.float16, torch.device("cpu"))
    bad = QuantResult(None, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32))  # no codes: packing fails
    packer.submit({"bad": bad})
    with pytest.raises(AttributeError):
        packer.packed()
    assert packer.pool._shutdown
