"""The background device warm-up: its calls must run (a typo there would only ever show on a GPU host)."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from quantize import warmup

ROOT = Path(__file__).resolve().parents[2]
WARM = """
import logging, torch
from quantize import gptq, warmup
logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
specs = [gptq.GptqSpec(4, 128, True, act_order=True, scale_dtype=torch.bfloat16, kernel="torch"),
         gptq.GptqSpec(4, 64, True, act_order=False, kernel="triton", update="tf32")]
warmup._warm(torch.device("cpu"), torch.float32, specs, head_dim=64)
print(sorted(warmup.outcome["parts_s"]))
"""


def test_warm_calls_run_without_error():
    # the calls the CUDA warm-up makes, on the CPU; the Triton sweep under its CPU interpreter (read by triton
    # when the kernel is defined, hence a fresh process)
    pytest.importorskip("triton")
    p = subprocess.run([sys.executable, "-c", WARM], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stderr
    assert "warm-up done" in p.stderr and "failed" not in p.stderr, p.stderr
    # each part is timed (warmup.outcome)
    assert p.stdout.split() == ["['attention',", "'context',", "'gemm',", "'gptq',", "'precompile_wait']"], p.stdout


def test_start_is_cuda_only_and_wait_never_deadlocks():
    warmup.start(torch.device("cpu"), torch.float32, [], 64)
    assert warmup._thread is None
    warmup.wait()
    # the warm-up thread's own GPTQ call waits on the warm-up: it must return at once there
    t = threading.Thread(target=warmup.wait)
    warmup._thread = t
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()
    warmup.wait()
    assert warmup._thread is None
