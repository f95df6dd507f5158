"""The tiny-model artifacts are pinned byte for byte: a refactor that changes one packed bit fails here.

Each variant is quantized on the CPU in float32 from a tiny Llama built from its config (seed 0), and every file
the artifact holds except the ones that record the run itself (manifest, report, model card: timings, dates,
versions) is hashed. The pins are per CPU class: torch's CPU matmuls differ in the last bit between
instruction sets, and not only ATen's own kernels (which ATEN_CPU_CAPABILITY selects) but oneDNN's and MKL's,
which follow the CPU's matrix extensions (AVX-512 BF16, AMX) whatever ATen is held to: an AVX-512 box held to
AVX2 still writes other bytes than an AVX2 box. So each class (ATen's capability and those extensions) has its
own pins, and a CPU of a class with none skips, saying so. The thread count is pinned too: a sum split over
another number of threads rounds differently (GPTQ's codes move with it), so the child runs with the pins' count
whatever the box has.
Regenerate with `python tests/integration/test_golden_artifacts.py` after a change meant to alter the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "tiny-artifacts.json"
# written per run: timings, dates, versions, paths; the error plot draws manifest figures with whatever matplotlib
# is installed (its pixels are not the codes' to pin)
RUN_RECORDS = {"manifest.json", "README.md", "output-error.png"}

VARIANTS = {
    "awq-gemm": dict(method="awq"),
    "awq-ct": dict(method="awq", format="compressed-tensors"),
    "gptq": dict(method="gptq", zero_point=False),
    "gptq-ct-asym": dict(method="gptq", zero_point=True, format="compressed-tensors"),
    "rtn-gemm": dict(method="rtn"),
}


def _bytes(p: Path) -> bytes:
    # both record where the source model lay, an absolute path (transformers writes it into a saved config's
    # `_name_or_path`; the resolved recipe resolves `model` against the recipe's directory); the rest of each
    # file is pinned byte for byte
    if p.name == "config.json":
        text = p.read_text()
        return text.replace(json.dumps(json.loads(text).get("_name_or_path", "")), '""').encode()
    if p.name == "recipe.yaml":
        return re.sub(rb"(?m)^model: .*$", b"model: ''", p.read_bytes(), count=1)
    return p.read_bytes()


def _hashes(art: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(_bytes(p)).hexdigest()
            for p in sorted(art.iterdir()) if p.is_file() and p.name not in RUN_RECORDS}


def build_all(tmp: Path) -> dict[str, dict[str, str]]:
    """Built under tmp with relative paths; the two files that still record the source path are normalised
    by `_bytes`."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import build_tiny_model, tiny_recipe
    from quantize import runner

    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        model = build_tiny_model(Path("model"), "llama")
        out = {}
        for name, over in VARIANTS.items():
            recipe = tiny_recipe(Path("."), model, name=f"golden-{name}", **over)
            out[name] = _hashes(runner.run(recipe, out_root="art"))
        return out
    finally:
        os.chdir(cwd)


# the matrix extensions oneDNN and MKL pick kernels by (their bf16 and fp16 GEMMs round otherwise)
MATRIX_FLAGS = ("avx512_bf16", "avx512_fp16", "amx_bf16")


def cpu_class() -> str:
    """ATen's CPU capability and the matrix extensions present, e.g. 'AVX2' or 'AVX512+amx_bf16+avx512_bf16+...'."""
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return "+".join([torch.backends.cpu.get_cpu_capability(), *sorted(f for f in MATRIX_FLAGS if f in flags)])


def _child_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}  # the class's own kernels
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def test_tiny_artifacts_are_byte_identical_to_the_pins(tmp_path):
    classes = json.loads(GOLDEN.read_text())["classes"]
    here = cpu_class()
    if here not in classes:
        pytest.skip(f"no pins for this CPU class ({here}; pinned: {', '.join(classes)}); "
                    f"`python {Path(__file__).relative_to(ROOT)}` on the code as landed adds them")
    pinned = classes[here]
    p = subprocess.run([sys.executable, __file__, "--hashes", str(tmp_path)], env=_child_env(pinned["threads"]),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert (got["cpu_class"], got["threads"]) == (here, pinned["threads"]), got
    for name, files in pinned["artifacts"].items():
        assert got["artifacts"][name] == files, f"{name}: the artifact's bytes changed"


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:2] == ["--hashes"]:  # the test's child: one JSON line on stdout
        print(json.dumps({"cpu_class": cpu_class(), "threads": torch.get_num_threads(),
                          "artifacts": build_all(Path(sys.argv[2]))}))
        raise SystemExit(0)
    # regenerating this CPU class's pins (the other classes' stay: a change meant to alter the bytes regenerates
    # each class on a box of it); they record the thread count they were built with, which the test's child then
    # uses (set OMP_NUM_THREADS to choose; this box's default otherwise)
    if "ATEN_CPU_CAPABILITY" in os.environ:
        raise SystemExit("error: unset ATEN_CPU_CAPABILITY: the pins are of each CPU class's own kernels")
    pins = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {"classes": {}}
    with tempfile.TemporaryDirectory() as d:
        pins["classes"][cpu_class()] = {"threads": torch.get_num_threads(), "torch": torch.__version__,
                                        "artifacts": build_all(Path(d))}
    GOLDEN.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
    print(f"wrote {cpu_class()}'s pins to {GOLDEN}")
