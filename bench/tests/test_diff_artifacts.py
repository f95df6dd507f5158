from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from bench.diff_artifacts import NotComparable, diff


def _artifact(root, tensors):
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    return root


def test_counts_differing_elements_per_tensor_kind(tmp_path):
    q = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    s = torch.ones(2, 4)
    a = _artifact(tmp_path / "a", {"l.0.qweight": q, "l.0.scales": s, "l.1.scales": s.clone()})
    q2, s2 = q.clone(), s.clone()
    q2[1, 3] += 1
    s2[0, 0] = 2.0
    s2[1, 2] = 3.0
    b = _artifact(tmp_path / "b", {"l.0.qweight": q2, "l.0.scales": s2, "l.1.scales": s.clone()})
    out = diff(a, b)
    assert out["tensors"]["qweight"] == {"elements": 16, "differ": 1, "share": 1 / 16}
    assert out["tensors"]["scales"]["elements"] == 16 and out["tensors"]["scales"]["differ"] == 2
    assert out["output_error"] is None  # no manifests: nothing to set side by side


def test_artifacts_with_other_tensors_are_refused(tmp_path):
    a = _artifact(tmp_path / "a", {"x.qweight": torch.zeros(2, dtype=torch.int32)})
    b = _artifact(tmp_path / "b", {"y.qweight": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(NotComparable, match="different tensors"):
        diff(a, b)
    with pytest.raises(NotComparable, match="no .safetensors"):
        diff(a, tmp_path / "missing")
