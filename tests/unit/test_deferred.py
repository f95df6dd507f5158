"""scikit-learn and SciPy deferred past transformers' config and model imports (pipeline/deferred.py): a config is
read and a model class built without importing either, transformers' assisted decoding and detection losses still
find them when they call them, and without the hook the same imports do pull them in (so the check can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import deferred
from tests.conftest import ROOT, build_tiny_model

pytest.importorskip("sklearn")  # and with it SciPy, which scikit-learn requires

# runs in a fresh interpreter: the hook changes process-wide import state
CHILD = r"""
import json, sys
from pipeline import deferred
if sys.argv[2] == "hook":
    deferred.defer_imports()
    deferred.defer_imports()  # a second call installs nothing more
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):
    AutoModelForCausalLM.from_config(config)
import transformers.utils
import transformers.generation.candidate_generator as cg
import transformers.loss.loss_for_object_detection as od
out = {"sklearn_after_model": "sklearn" in sys.modules,
       "scipy_after_model": "scipy.optimize" in sys.modules,
       "hooks": sum(type(f).__name__ == "_Finder" for f in sys.meta_path),
       "check_is_transformers_own": cg.is_sklearn_available is transformers.utils.is_sklearn_available
                                    and transformers.utils.is_sklearn_available.__module__.startswith("transformers"),
       "available": cg.is_sklearn_available()}
y, score = [0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]
fpr, tpr, thr = cg.roc_curve(y, score)  # what assisted decoding calls
from sklearn.metrics import roc_curve
want = roc_curve(y, score)
out["roc_same"] = all(list(a) == list(b) for a, b in zip((fpr, tpr, thr), want))
out["source"] = bool(cg.__loader__.get_source(cg.__name__))
cost = torch.tensor([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
rows, cols = od.linear_sum_assignment(cost)  # what the detection losses' matcher calls
from scipy.optimize import linear_sum_assignment
out["assignment_same"] = [list(rows), list(cols)] == [list(x) for x in linear_sum_assignment(cost)]
out["scipy_check_is_transformers_own"] = od.is_scipy_available is transformers.utils.is_scipy_available
out["scipy_available"] = od.is_scipy_available()
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
    assert hooked == {"sklearn_after_model": False, "scipy_after_model": False, "hooks": 1,
                      "check_is_transformers_own": True, "available": True, "roc_same": True, "source": True,
                      "assignment_same": True, "scipy_check_is_transformers_own": True, "scipy_available": True}
    plain = _child(model, "plain")
    assert plain["sklearn_after_model"] is True and plain["scipy_after_model"] is True
    assert plain["hooks"] == 0 and plain["roc_same"] is True and plain["assignment_same"] is True


def test_the_command_line_entry_point_defers_it(tmp_path):
    """`python -m pipeline preflight` of a tiny model: the whole command imports neither scikit-learn nor SciPy."""
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
    assert "transformers.loss.loss_for_object_detection" in imported and "scipy" not in imported


def test_the_names_a_module_imports_from_a_library():
    src = ("import os\nfrom ..utils import is_scipy_available\nif is_scipy_available():\n"
           "    from scipy.optimize import linear_sum_assignment\n    from scipy.special import expit as sigmoid\n")
    assert deferred.imported_names(src, "scipy") == {"linear_sum_assignment": ("scipy.optimize", "linear_sum_assignment"),
                                                     "sigmoid": ("scipy.special", "expit")}
    assert deferred.imported_names(src, "sklearn") == {}
    # a function's own import runs when it is called; a try block's at the top level
    assert deferred.imported_names("def f():\n    from scipy.stats import norm\n", "scipy") == {}
    assert deferred.imported_names("try:\n    from scipy.stats import norm\nexcept ImportError:\n    pass\n",
                                   "scipy") == {"norm": ("scipy.stats", "norm")}
    # a library bound as a module, or a star import, is no function's to stand in for: imported as it would be
    assert deferred.imported_names("if x():\n    import scipy.optimize\n", "scipy") is None
    assert deferred.imported_names("if x():\n    from scipy.optimize import *\n", "scipy") is None
    assert deferred.library_for("transformers.loss.loss_rt_detr") == "scipy"
    assert deferred.library_for("transformers.lossy") is None
    f = deferred.lazy("math", "hypot")
    assert f(3, 4) == 5.0 and f.__name__ == "hypot"
