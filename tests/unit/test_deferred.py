"""scikit-learn deferred past transformers' config and model imports (pipeline/deferred.py): a config is read
and a model class built without importing it, transformers' assisted decoding still finds it when it calls it,
and without the hook the same imports do pull it in (so the check can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, build_tiny_model

pytest.importorskip("sklearn")

# runs in a fresh interpreter: the hook changes process-wide import state
CHILD = r"""
import json, sys
from pipeline import deferred
if sys.argv[2] == "hook":
    deferred.defer_sklearn()
    deferred.defer_sklearn()  # a second call installs nothing more
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):
    AutoModelForCausalLM.from_config(config)
import transformers.utils
import transformers.generation.candidate_generator as cg
out = {"sklearn_after_model": "sklearn" in sys.modules,
       "hooks_left": sum(type(f).__name__ == "_Finder" for f in sys.meta_path),
       "check_is_transformers_own": cg.is_sklearn_available is transformers.utils.is_sklearn_available
                                    and transformers.utils.is_sklearn_available.__module__.startswith("transformers"),
       "available": cg.is_sklearn_available()}
y, score = [0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]
fpr, tpr, thr = cg.roc_curve(y, score)  # what assisted decoding calls
from sklearn.metrics import roc_curve
want = roc_curve(y, score)
out["roc_same"] = all(list(a) == list(b) for a, b in zip((fpr, tpr, thr), want))
out["source"] = bool(cg.__loader__.get_source(cg.__name__))
print(json.dumps(out))
"""


def _child(model, mode: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", CHILD, str(model), mode], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_config_and_a_model_class_without_sklearn_and_roc_curve_on_call(tmp_path):
    model = build_tiny_model(tmp_path / "m", "llama")
    hooked = _child(model, "hook")
    assert hooked == {"sklearn_after_model": False, "hooks_left": 0, "check_is_transformers_own": True,
                      "available": True, "roc_same": True, "source": True}
    plain = _child(model, "plain")
    assert plain["sklearn_after_model"] is True and plain["roc_same"] is True


def test_the_command_line_entry_point_defers_it(tmp_path):
    """`python -m pipeline preflight` of a tiny model: the whole command imports no scikit-learn."""
    model = build_tiny_model(tmp_path / "m", "llama")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(json.dumps({"name": "tiny", "model": str(model), "method": "rtn", "w_bit": 4,
                                  "q_group_size": 32, "zero_point": True, "version": "gemm", "device": "cpu"}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipeline", "preflight", str(recipe), "--out",
                        str(tmp_path / "a")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "transformers.generation.candidate_generator" in imported and "sklearn" not in imported
