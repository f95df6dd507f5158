"""bench/gpu_dist.py: its job names and commands, and one --tiny --device cpu run (two gloo ranks) end to end."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import gpu_dist
from tests.integration.test_distributed import GPTQ_LINEAR_LOSS_RTOL, GPTQ_TOTAL_LOSS_RTOL


def test_jobs_and_commands(tmp_path):
    args = gpu_dist.parse_args(["--only", "ours-72b,llmc-72b-gptq-2gpu", "--work", str(tmp_path)])
    assert args.jobs == ["ours-72b-awq-1gpu", "ours-72b-awq-2gpu", "ours-72b-gptq-1gpu", "ours-72b-gptq-2gpu",
                         "llmc-72b-gptq-2gpu"]
    one, two = (gpu_dist.job_command(j, "/m", args) for j in ("ours-72b-gptq-1gpu", "ours-72b-gptq-2gpu"))
    assert "torch.distributed.run" not in one and one[1].endswith("bench_ours.py")
    assert two[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert two[6].endswith("bench_ours.py") and two[7] == one[2]  # the same recipe at 1 and 2 ranks
    peer = gpu_dist.job_command("llmc-72b-gptq-2gpu", "/m", args)
    assert peer[6].endswith("llmc_dist.py") and peer[peer.index("--method") + 1] == "gptq"
    with pytest.raises(SystemExit):
        gpu_dist.parse_args(["--only", "ours-13b-awq-1gpu"])


def test_tiny_cpu_run_at_one_and_two_ranks(tmp_path):
    """GPTQ at 1 and 2 gloo ranks on the bench's bf16 Qwen2 shape, where the two runs' codes do differ (the
    Hessian sums add in another order): the record and the bound of docs/DISTRIBUTED.md on GPTQ's losses."""
    out = tmp_path / "out"
    rc = gpu_dist.main(["--tiny", "--device", "cpu", "--only", "ours-7b-gptq-1gpu,ours-7b-gptq-2gpu,llmc-7b-awq-2gpu",
                        "--batch-size", "2", "--work", str(tmp_path / "w"), "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "gpu_dist.json").read_text())
    one, two = report["runs"]["ours-7b-gptq-1gpu"], report["runs"]["ours-7b-gptq-2gpu"]
    assert one["world_size"] == 1 and two["world_size"] == 2 and [r["rank"] for r in two["ranks"]] == [0, 1]
    assert len(two["ranks"][1]["layer_s"]) == one["per_layer"]["n"]  # rank 1 worked through every layer too
    losses = [{f"{i}.{n}": s["loss"] for i, layer in json.loads((Path(r["artifact"]) / "manifest.json").read_text())
               ["gptq_stats"].items() for n, s in layer.items() if n != "seconds"} for r in (one, two)]
    assert losses[0].keys() == losses[1].keys()
    assert all(abs(losses[0][k] - losses[1][k]) <= GPTQ_LINEAR_LOSS_RTOL * losses[0][k] for k in losses[0])
    assert abs(sum(losses[0].values()) - sum(losses[1].values())) <= GPTQ_TOTAL_LOSS_RTOL * sum(losses[0].values())
    row = next(r for r in report["summary"] if r["runner"] == "ours")
    assert row["speedup"] == round(row["s_per_layer_1"] / row["s_per_layer_2"], 2)
    peer = report["runs"]["llmc-7b-awq-2gpu"]
    if importlib.util.find_spec("llmcompressor") is None:
        assert peer["supported"] is False and "No module named" in peer["reason"]
    assert "7b    gptq   ours" in "\n".join(report["table"])
