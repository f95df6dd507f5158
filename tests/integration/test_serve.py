"""The artifact's serve config against vLLM's own argument parser, and real servers on tiny models: served name,
chat, the 404 for a wrong name, a port taken meanwhile, and no process left behind."""

import json
import socket

import pytest
import yaml

from eval import serve
from eval.serve import Server, ServeError, chat, served_models
from quantize import runner
from quantize.export import serve_config
from quantize.preflight.checks import PreflightError
from tests.conftest import tiny_recipe


@pytest.fixture(scope="module")
def tiny_served(tiny_llama, tmp_path_factory):
    """A tiny round-to-nearest artifact with every serve: key set."""
    tmp = tmp_path_factory.mktemp("serve")
    recipe = tiny_recipe(tmp, tiny_llama, name="tiny-serve", method="rtn",
                         serve=dict(served_model_name="tiny-chat", max_model_len=512, kv_cache_dtype="auto"))
    return runner.run(recipe, out_root=tmp / "a")


def _vllm_parse(argv):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def test_serve_config_parses_with_vllms_parser(tiny_served):
    from vllm.engine.arg_utils import AsyncEngineArgs

    path = tiny_served / serve_config.SERVE_CONFIG
    args = _vllm_parse(["--model", str(tiny_served), "--config", str(path)])
    engine = AsyncEngineArgs.from_cli_args(args)
    assert (engine.quantization, engine.served_model_name, engine.dtype, engine.max_model_len,
            engine.tensor_parallel_size, engine.kv_cache_dtype) == ("awq_marlin", ["tiny-chat"], "float16", 512, 1,
                                                                    "auto")
    manifest = json.loads((tiny_served / "manifest.json").read_text())
    from quantize.files import sha256_file

    assert manifest["files"][serve_config.SERVE_CONFIG]["sha256"] == sha256_file(path)
    card = (tiny_served / "README.md").read_text()
    assert "vllm serve . --config vllm-serve.yaml" in card and '"model": "tiny-chat"' in card


def test_vllms_parser_refuses_a_bad_config(tiny_served, tmp_path):
    """Negative control: the same parser rejects a value vLLM does not know, so the test above can fail."""
    cfg = yaml.safe_load((tiny_served / serve_config.SERVE_CONFIG).read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**cfg, "kv-cache-dtype": "int3"}))
    with pytest.raises(SystemExit):
        _vllm_parse(["--model", str(tiny_served), "--config", str(bad)])


@pytest.mark.parametrize("serve_keys,needle", [
    (dict(tensor_parallel_size=8), "serve.tensor_parallel_size 8"),  # hidden 256 / 8 = 32: g64 does not divide it
    (dict(max_model_len=4096), "serve.max_model_len 4096 exceeds the model's max_position_embeddings 1024"),
    (dict(kv_cache_dtype="fp8", targets=[dict(compute_capability=9.0)]),
     "serve.kv_cache_dtype fp8 with dtype float16 on serve.targets compute capability 9.0"),
])
def test_preflight_refuses_serve_settings_the_model_cannot_take(tiny_llama, tmp_path, serve_keys, needle):
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-bad-serve", method="rtn", serve=serve_keys)
    with pytest.raises(PreflightError, match="use"):
        try:
            runner.preflight_only(str(recipe), out_root=tmp_path / "a")
        except PreflightError as e:
            assert needle in str(e), str(e)
            raise
    assert not (tmp_path / "a" / "tiny-bad-serve").exists()


def _api_servers() -> set[int]:
    """This interpreter's vLLM servers: another test run on the same machine (another checkout's venv) starts and
    stops its own, which must not count here."""
    import subprocess
    import sys

    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {int(ln.split()[0]) for ln in ps.splitlines()
            if "eval.vllm_server" in ln and ln.split(None, 1)[1].startswith(sys.executable)}


@pytest.mark.vllm
@pytest.mark.vllm_no_4bit
def test_server_round_trip_and_wrong_name(tiny_llama, tmp_path, monkeypatch):
    """Unquantized tiny model (the server path, on any CPU): a port taken between picking and binding is
    retried, /v1/models lists the served name, chat answers, a wrong name's 404 names the right one."""
    before = _api_servers()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = serve.free_port
    monkeypatch.setattr(serve, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    try:
        with Server(tiny_llama, {"served-model-name": "tiny-fp16", "dtype": "float16", "max-model-len": 256},
                    log=tmp_path / "server.log", timeout=400) as srv:
            assert srv.port != taken.getsockname()[1]
            assert served_models(srv.url) == ["tiny-fp16"]
            assert chat(srv.url, "tiny-fp16", "Hello", max_tokens=8)
            with pytest.raises(ServeError) as e:
                chat(srv.url, "tiny-awq", "Hello", max_tokens=8)
            assert "404" in str(e.value) and "send \"model\": 'tiny-fp16'" in str(e.value), str(e.value)
    finally:
        taken.close()
    assert "Address already in use" in (tmp_path / "server.log").read_text()
    assert _api_servers() <= before  # stopped, with its workers


@pytest.mark.vllm
def test_quantized_artifact_serves_with_its_config(tiny_served, tmp_path):
    """The artifact's own vllm-serve.yaml, as make serve starts it: served name, chat, the 4-bit kernel logged."""
    why = serve.int4_kernel_missing()
    if why:
        pytest.skip(why)
    with Server(tiny_served, log=tmp_path / "server.log", timeout=400) as srv:
        assert srv.name == "tiny-chat" and served_models(srv.url) == ["tiny-chat"]
        assert chat(srv.url, "tiny-chat", "Hello", max_tokens=8)
    assert "quantization=awq" in (tmp_path / "server.log").read_text()


@pytest.mark.vllm
@pytest.mark.vllm_no_4bit
def test_smoke_goes_through_the_server(tiny_llama):
    """The eval's smoke stage on a 16-bit directory (no serve config: served as the directory's name): every
    server check, greedy completions from token ids, and the reference loaded only after the server is gone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.smoke import smoke

    seen = {}

    def reference():
        seen["servers_alive"] = _api_servers()
        return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32")

    before = _api_servers()
    res = smoke(tiny_llama, reference, AutoTokenizer.from_pretrained(tiny_llama), max_tokens=8, min_agreement=0.9)
    assert res["passed"], res["errors"]
    assert res["served_name"] == tiny_llama.name and res["method"] is None
    assert set(res["checks"]) == {"loaded", "models_lists_served_name", "answers", "wrong_name_404", "method",
                                  "not_degenerate", "agreement"}
    assert all(len(x["completion"]) for x in res["samples"]) and res["token_agreement"] >= 0.9
    assert seen["servers_alive"] <= before  # vLLM had exited before the reference loaded


@pytest.mark.vllm
@pytest.mark.vllm_no_4bit
@pytest.mark.slow
def test_bench_serve_end_to_end(tiny_served):
    """make bench-serve on a tiny artifact, one level, 4 short requests: vLLM's benchmark measures the FP16 side;
    the quantized side is measured too, or, where the CPU build has no 4-bit kernel, fails with that cause."""
    from eval import bench_serve

    before = _api_servers()
    r = bench_serve.bench(tiny_served, 4, 16, 4, [2], timeout=400)
    fp = r["fp16"]["levels"][2]
    assert fp["completed"] == 4 and fp["failed"] == 0 and fp["output_throughput"] > 0 and fp["p95_ttft_ms"] > 0
    assert r["fp16"]["served_name"] == "tiny-chat-fp16"
    q = r["quantized"]["levels"][2]
    if serve.int4_kernel_missing():
        assert "cpu_gemm_wna16" in q["error"]
    else:
        assert q["completed"] == 4 and q["output_throughput"] > 0
    stem = tiny_served.parent / "tiny-serve-bench-serve"
    assert "| 2 | fp16 `tiny-chat-fp16` |" in stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").is_file() and json.loads(stem.with_suffix(".json").read_text())["fp16"]
    assert _api_servers() <= before
