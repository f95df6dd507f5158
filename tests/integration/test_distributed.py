"""Several ranks (torchrun, gloo on the CPU) quantize what one process quantizes.

Each test launches real torchrun processes on a tiny Llama: two ranks on one node, two single-rank "nodes"
meeting at a rendezvous on localhost, and a failure on rank 1 that must stop both ranks with its message.
AWQ and SignRound artifacts are byte-identical to the one-process run. GPTQ sums the ranks' Hessians in another order than
one process's running mean, so its codes may differ: its artifact is held to the bound docs/DISTRIBUTED.md
states, on GPTQ's own objective (each linear's loss in the manifest).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantize import runner
from tests.conftest import build_tiny_model, tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "integration" / "dist_worker.py"
# timings, dates, the world size; the error plot draws the manifest's output errors, whose last bits follow
# GPTQ's Hessian sums (added in another order over ranks)
RUN_RECORDS = {"manifest.json", "README.md", "output-error.png"}
GPTQ_LINEAR_LOSS_RTOL = 0.05  # docs/DISTRIBUTED.md: each linear's GPTQ loss, N ranks against one
GPTQ_TOTAL_LOSS_RTOL = 0.01  # and the sum over every linear
TIMEOUT_S = 300  # catches a hang; 3 ranks on 2 cores that other work also uses are slow, not hung


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dist-llama"), "llama", hidden=128, intermediate=256, layers=2)


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "QUANTIZE_DIST_TIMEOUT_S": "240"}
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher]


def _one_rank(recipe: Path, out: Path) -> Path:
    return runner.run(recipe, out_root=out)


def _run_ranks(recipe: Path, out: Path, n: int, cwd: Path) -> Path:
    """`torchrun --standalone --nproc-per-node n -m pipeline run recipe` -> the artifact it wrote (must exit 0)."""
    p = subprocess.run(_torchrun("--standalone", "--nproc-per-node", str(n), "-m", "pipeline", "run", str(recipe),
                                 "--out", str(out)), env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT_S, cwd=cwd)
    assert p.returncode == 0, p.stderr[-3000:]
    return out / recipe.stem


def _same_files(a: Path, b: Path) -> list[str]:
    names = sorted(p.name for p in a.iterdir() if p.is_file() and p.name not in RUN_RECORDS)
    assert names == sorted(p.name for p in b.iterdir() if p.is_file() and p.name not in RUN_RECORDS)
    return [n for n in names if (a / n).read_bytes() != (b / n).read_bytes()]


def _gptq_losses(art: Path) -> dict[str, float]:
    stats = json.loads((art / "manifest.json").read_text())["gptq_stats"]
    return {f"{layer}.{n}": s["loss"] for layer, linears in stats.items() for n, s in linears.items() if n != "seconds"}


VARIANTS = {
    "awq": {},
    # GPTQ's rounding on AWQ's grids (one owner per shared input), a coarse-to-fine search (rounds of candidates;
    # the default "awq" variant spreads the screened search's two rounds)
    "awq-gptq-rounding": dict(awq=dict(n_grid=10, clip_grid=10, rounding="gptq", screen_keep=None),
                              advanced=dict(awq=dict(coarse_step=2))),
    "gptq": dict(method="gptq", zero_point=False),
    # one owner tunes each layer on every batch (gathered bit for bit) and shares the codes: byte-identical
    "signround": dict(method="signround", signround=dict(iters=10, samples_per_step=4)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_write_the_one_rank_artifact(small_llama, tmp_path, variant):
    method = "gptq" if variant == "gptq" else "awq"
    recipe = tiny_recipe(tmp_path, small_llama, name=f"dist-{variant}", eval=dict(enabled=False), **VARIANTS[variant])
    one = _one_rank(recipe, tmp_path / "one")
    two = _run_ranks(recipe, tmp_path / "two", 2, tmp_path)
    assert '"world_size": 2' in (two / "manifest.json").read_text()
    differ = _same_files(one, two)
    if method == "awq":
        assert differ == [], f"AWQ on two ranks must be byte-identical; differ: {differ}"
    else:
        # the routed-token heatmap follows the router's choices, which may differ with the codes
        assert set(differ) <= {"model.safetensors", "experts.png"}, differ
        a, b = _gptq_losses(one), _gptq_losses(two)
        assert a.keys() == b.keys() and len(a) == 14  # 2 layers x 7 linears
        far = {k: (a[k], b[k]) for k in a if abs(a[k] - b[k]) > GPTQ_LINEAR_LOSS_RTOL * a[k]}
        assert far == {}, f"GPTQ losses beyond the bound: {far}"
        assert abs(sum(a.values()) - sum(b.values())) <= GPTQ_TOTAL_LOSS_RTOL * sum(a.values())
        tensors_one, tensors_two = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
        assert tensors_one.keys() == tensors_two.keys()
        for k, t in tensors_one.items():  # the 16-bit tensors GPTQ leaves alone are the same bits
            if not k.endswith(("qweight", "qzeros", "scales", "g_idx")):
                assert torch.equal(t, tensors_two[k]), k


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_more_ranks_than_batches(small_llama, tmp_path, method):
    """3 ranks, 2 calibration batches: rank 0 forwards nothing and still takes its share of candidates, owners and
    rows; the artifact is the one-rank one (GPTQ: within the bound; here identical)."""
    over = dict(method="gptq", zero_point=False) if method == "gptq" else {}
    recipe = tiny_recipe(tmp_path, small_llama, name=f"dist3-{method}", eval=dict(enabled=False),
                         calibration=dict(dataset="groups-merged", n_samples=8, seq_len=64, seed=0), **over)
    one = _one_rank(recipe, tmp_path / "one")
    three = _run_ranks(recipe, tmp_path / "three", 3, tmp_path)
    differ = _same_files(one, three)
    assert differ == [] if method == "awq" else set(differ) <= {"model.safetensors"}, differ
    if method == "gptq":
        a, b = _gptq_losses(one), _gptq_losses(three)
        assert all(abs(a[k] - b[k]) <= GPTQ_LINEAR_LOSS_RTOL * a[k] for k in a)


@pytest.mark.parametrize("where", ["unit", "layer"])
def test_a_failure_on_rank_1_stops_both_ranks_with_its_message(small_llama, tmp_path, where):
    recipe = tiny_recipe(tmp_path, small_llama, name="dist-fail", eval=dict(enabled=False))
    out = tmp_path / "art"
    p = subprocess.run(_torchrun("--standalone", "--nproc-per-node", "2", "--tee", "3", str(WORKER), "run", str(recipe),
                                 "--out", str(out)), env=_env(DIST_TEST_FAIL=f"1:{where}"), capture_output=True,
                       text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert p.returncode != 0
    text = p.stdout + p.stderr
    errors = [line for line in text.splitlines() if "error:" in line and "injected failure on this rank" in line]
    assert any(line.startswith("[default0]") for line in errors), text[-3000:]  # rank 0 shows rank 1's message
    assert any(line.startswith("[default1]") for line in errors), text[-3000:]
    assert all("rank 1" in line for line in errors if line.startswith("[default0]")), errors
    left = sorted(q.name for q in out.iterdir() if not q.name.endswith(".lock")) if out.exists() else []
    assert left == [], f"nothing may be half-written: {left}"


def test_two_nodes_meet_at_a_rendezvous_on_localhost(small_llama, tmp_path):
    recipe = tiny_recipe(tmp_path, small_llama, name="dist-nodes", eval=dict(enabled=False))
    one = _one_rank(recipe, tmp_path / "one")
    port = _free_port()
    # On a cluster only node 0's address matches the endpoint, so node 0's launcher hosts the rendezvous store;
    # on one machine both match and whichever binds first would host, so each is told, as on a cluster
    nodes = [subprocess.Popen(_torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                        "--rdzv-conf", f"is_host={int(rank == 0)}",
                                        "--rdzv-id", "dist-test", "-m", "pipeline", "run", str(recipe),
                                        "--out", str(tmp_path / "two")),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for rank in (0, 1)]
    results = []
    try:
        for node in nodes:
            results.append(node.communicate(timeout=TIMEOUT_S))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [n.returncode for n in nodes] == [0, 0], [r[1][-2000:] for r in results]
    assert _same_files(one, tmp_path / "two" / recipe.stem) == []


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_two_ranks_on_a_moe_model(tmp_path, method):
    """Experts under several ranks: every rank holds every token of a layer, so each computes the expert work
    itself (docs/DISTRIBUTED.md) and rank 0 writes it. AWQ is byte-identical to one process, routed token counts
    included; GPTQ's experts see the attention GPTQ quantized on two ranks (whose codes may differ, so may a
    router's choices), so its artifact is held to the total loss bound."""
    model = build_tiny_model(tmp_path / "moe", "qwen3_moe", hidden=64, intermediate=128, layers=2)
    over = dict(method="gptq", zero_point=False) if method == "gptq" else {}
    recipe = tiny_recipe(tmp_path, model, name=f"dist-moe-{method}", eval=dict(enabled=False), **over)
    one = _one_rank(recipe, tmp_path / "one")
    two = _run_ranks(recipe, tmp_path / "two", 2, tmp_path)
    differ = _same_files(one, two)
    s1, s2 = (json.loads((a / "manifest.json").read_text())[f"{method}_stats"] for a in (one, two))
    e1, e2 = ({k: v["experts"] for k, v in s.items()} for s in (s1, s2))
    assert len(e1) == 2 and [e["tokens"] for e in e1.values()] == [e["tokens"] for e in e2.values()]
    if method == "awq":
        assert e1 == e2, "routed token counts differ from one process's"
        assert differ == [], f"AWQ on two ranks must be byte-identical; differ: {differ}"
    else:
        # the routed-token heatmap follows the router's choices, which may differ with the codes
        assert set(differ) <= {"model.safetensors", "experts.png"}, differ
        a, b = _gptq_losses(one), _gptq_losses(two)
        assert a.keys() == b.keys() and a
        assert abs(sum(a.values()) - sum(b.values())) <= GPTQ_TOTAL_LOSS_RTOL * sum(a.values())
