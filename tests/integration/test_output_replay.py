"""GPTQ's true-sequential stages and its chain's forward reuse the outputs of the linears already quantized
(`capture.replay`): the same artifact, byte for byte, with each of those products computed once per batch."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import pytest
import torch.nn as nn

from quantize import runner
from quantize.capture import replay
from tests.conftest import build_tiny_model, tiny_recipe

GPTQ = dict(method="gptq", zero_point=False, gptq=dict(act_order=True, true_sequential=True, block_size=64))
N_SAMPLES, BATCH = 16, 4


def _weights(art: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(art.glob("*.safetensors"))}


def _run(tmp: Path, model: Path, name: str, monkeypatch, keep: bool, **over) -> tuple[dict, Counter]:
    """One GPTQ run -> its weight files' hashes and how often a linear of each (in, out) shape computed."""
    computed: Counter = Counter()
    own = nn.Linear.forward

    def counting(self, x):
        computed[(self.in_features, self.out_features)] += 1
        return own(self, x)
    with monkeypatch.context() as m:
        m.setattr(nn.Linear, "forward", counting)
        if not keep:
            m.setattr(replay, "BUDGET_SHARE", 0.0)  # nothing fits: every forward computes every linear
        recipe = tiny_recipe(tmp, model, name=name, calibration=dict(dataset="groups-merged", n_samples=N_SAMPLES,
                             seq_len=64, seed=0), batch_size=BATCH, **{**GPTQ, **over})
        art = runner.run(recipe, out_root=tmp / "art")
    return _weights(art), computed


def test_each_quantized_linear_computes_once_per_batch_and_the_artifact_is_the_same(tiny_llama, tmp_path,
                                                                                     monkeypatch):
    plain, computed_plain = _run(tmp_path, tiny_llama, "plain", monkeypatch, keep=False)
    kept, computed_kept = _run(tmp_path, tiny_llama, "kept", monkeypatch, keep=True)
    assert kept == plain
    # tiny Llama: hidden 256, 4 heads of 64, 2 key/value heads, intermediate 512; 2 layers x 4 batches. Per layer
    # and batch the four stages' forwards and the chain's computed q/k/v 4 times, o 3, gate/up 2, down 1.
    per = 2 * N_SAMPLES // BATCH
    saved = {k: computed_plain[k] - computed_kept[k] for k in computed_plain}
    assert saved[(256, 256)] == (3 + 2) * per  # q_proj and o_proj
    assert saved[(256, 128)] == (3 + 3) * per  # k_proj, v_proj
    assert saved[(256, 512)] == (1 + 1) * per  # gate_proj, up_proj
    assert saved[(512, 256)] == 0  # down_proj: computed once in either
    assert computed_kept[(512, 256)] == per


@pytest.mark.parametrize("kind,over", [
    ("qwen3_moe", {}),  # attention replayed; the experts' own forwards run block by block
    ("llama", dict(gptq=dict(act_order=True, true_sequential=True, block_size=64, fp_target=0.5))),  # FP target
])
def test_the_same_artifact_with_and_without_the_replay(kind, over, tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / kind, kind, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1)
    plain, computed_plain = _run(tmp_path, model, "plain", monkeypatch, keep=False, **over)
    kept, computed_kept = _run(tmp_path, model, "kept", monkeypatch, keep=True, **over)
    assert kept == plain
    assert computed_kept[(64, 128)] < computed_plain[(64, 128)]  # q_proj (2 heads of 64) replayed
