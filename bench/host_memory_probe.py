"""Does loading a checkpoint copy it into private host memory? RSS (anonymous and file-backed) before and
after `quantize.source.load_model`, and after reading one decoder layer.

    python bench/build_checkpoint.py --config bench/configs/qwen2.5-7b --layers 4 --device cpu --out /tmp/ckpt7b-l4
    python bench/host_memory_probe.py /tmp/ckpt7b-l4            (prints one JSON line)

File-backed pages (RssFile) are the safetensors files mapped into memory: the kernel can drop them under
pressure, so a model larger than RAM can still pass through layer by layer. Anonymous pages cannot.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from quantize import source  # noqa: E402


def rss() -> dict[str, float]:
    """VmRSS / RssAnon / RssFile of this process in GB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(line.split()[1]) * 1024 / 1e9, 3)
    return out


def main() -> None:
    src = source.resolve(sys.argv[1])
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
    record = {"checkpoint": str(src.path), "dtype": str(dtype), "before": rss()}
    t = time.perf_counter()
    model = source.load_model(src, dtype)
    record["load_s"] = round(time.perf_counter() - t, 2)
    record["after_load"] = rss()
    record["param_gb"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, 3)
    layer = model.model.layers[1]
    with torch.no_grad():
        record["layer1_checksum"] = float(sum(p.float().sum() for p in layer.parameters()))
    record["after_reading_layer_1"] = rss()
    print(json.dumps(record))


if __name__ == "__main__":
    main()
