"""`make serve` on a 4-bit artifact where vLLM has no 4-bit kernel (an AVX2-only CPU) refuses at once with the
reason, exit 2, instead of printing its URL and dying at the first request; a 16-bit model still serves there.
The probe is replaced: the box that runs the tests may have the kernel."""

from __future__ import annotations

import json

import pytest

from eval import serve
from pipeline.cli import main as cli_main
from quantize.errors import run_main

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}


def _model(tmp_path, qcfg: dict | None):
    d = tmp_path / ("w4" if qcfg else "fp16")
    d.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (d / "config.json").write_text(json.dumps({**config, **({"quantization_config": qcfg} if qcfg else {})}))
    return d


class _Started(Exception):
    pass


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.setattr(serve, "int4_kernel_missing", lambda: serve.INT4_MISSING)
    started = []

    def server(model_dir, **kw):
        started.append(model_dir)
        raise _Started

    monkeypatch.setattr(serve, "Server", server)
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)  # main's handlers stay out of the test process
    return started


@pytest.mark.parametrize("entry", ["pipeline serve", "python -m eval.serve"])
def test_a_4bit_artifact_is_refused_before_the_server_starts(entry, tmp_path, no_kernel, capsys):
    d = _model(tmp_path, AWQ)
    code = cli_main(["serve", str(d)]) if entry == "pipeline serve" else run_main(serve.main, [str(d)])
    err = capsys.readouterr().err
    assert code == 2 and no_kernel == []
    assert err == f"error: {d} holds 4-bit weights and cannot be served here: {serve.INT4_MISSING}\n"
    assert "serve them on a CUDA host or an AVX-512 CPU" in err


def test_a_16bit_model_is_not_refused(tmp_path, no_kernel):
    d = _model(tmp_path, None)
    with pytest.raises(_Started):
        serve.main([str(d)])
    assert no_kernel == [d]


def test_where_the_kernel_exists_a_4bit_artifact_starts(tmp_path, no_kernel, monkeypatch):
    monkeypatch.setattr(serve, "int4_kernel_missing", lambda: None)
    d = _model(tmp_path, AWQ)
    with pytest.raises(_Started):
        serve.main([str(d)])
    assert no_kernel == [d]
