"""bench/preflight_time.py's checkpoint: weight files that hold headers only, which pre-flight accepts as whole."""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from bench.build_checkpoint import ROOT
from bench.preflight_time import headers_only


def test_headers_only_checkpoint_passes_the_integrity_check(tmp_path):
    from quantize.source import integrity, load as source
    from quantize.source.arch import arch_for

    out = tmp_path / "ckpt"
    made = headers_only(ROOT / "bench" / "configs" / "qwen2.5-7b", out, tiny=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == made["tensors"] and index["metadata"]["total_size"] == made["bytes"]
    for fname in set(index["weight_map"].values()):
        path = out / fname
        assert os.stat(path).st_blocks * 512 < path.stat().st_size  # the data is a hole, not written bytes
        with safe_open(str(path), "pt") as f:  # a header and data size that safetensors accepts as a file
            assert set(f.keys()) == {n for n, v in index["weight_map"].items() if v == fname}
    src = source.resolve(str(out))
    config = source.read_config(src)
    integrity.check_tensors(src, config, arch_for(config))  # every tensor the config implies, shaped as it says
