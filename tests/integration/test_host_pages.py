"""Once a decoder layer's device copy exists, its memory-mapped checkpoint pages leave the process (the GPU path's
peak RSS would otherwise hold the whole checkpoint): the pages go, every value reads back the same, and a page
written in place is never thrown away."""

from __future__ import annotations

import mmap

import pytest
import torch

from quantize.capture import hostpages
from quantize.capture.device import Uploader
from quantize.source import load
from tests.conftest import build_tiny_model

pytestmark = pytest.mark.skipif(not hostpages.supported(), reason="needs Linux's /proc/self/pagemap")


def _rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_uploader_unmaps_a_copied_layers_pages_and_they_read_back(tmp_path):
    src = load.resolve(str(build_tiny_model(tmp_path / "m", hidden=512, intermediate=1536, layers=2)))
    model = load.load_model(src, torch.float16)  # float16 as stored: parameters are views of the mapped file
    layers = model.model.layers
    assert hostpages.in_file_mapping(layers[0].mlp.up_proj.weight)
    written = layers[1].mlp.up_proj.weight
    with torch.no_grad():
        written[written.shape[0] // 2, :8] = 3.0  # a page in the middle of the tensor becomes this process's own
    expected = {n: p.detach().clone() for n, p in layers.named_parameters()}  # also maps every page in
    whole_pages = sum((p.numel() * p.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
                      for n, p in layers.named_parameters() if p is not written)
    rss = _rss_file()

    up = Uploader(layers, torch.device("cpu"))
    copies = [up.get(i, torch.float32) for i in range(len(layers))]  # float32: a copy, not the mapped memory

    assert up.released >= 0.9 * whole_pages  # every tensor but the written one (partial end pages stay)
    assert _rss_file() <= rss - 0.9 * up.released
    for n, p in layers.named_parameters():  # read back from the file: the same values, the write kept
        assert torch.equal(p.detach(), expected[n]), n
    assert bool((written[written.shape[0] // 2, :8] == 3.0).all())
    for i, c in enumerate(copies):
        for (n, p), (_, q) in zip(layers[i].named_parameters(), c.named_parameters()):
            assert torch.equal(p.detach().float(), q), n


def test_memory_not_in_a_file_mapping_is_never_released():
    t = torch.randn(4 * mmap.PAGESIZE)  # anonymous memory: MADV_DONTNEED would zero it
    before = t.clone()
    assert not hostpages.in_file_mapping(t)
    assert hostpages.release([t]) == 0 and torch.equal(t, before)
