"""A base model (a tokenizer with no chat template, as most base checkpoints and many GGUF files have): vLLM's chat
endpoint refuses it with HTTP 400, so the smoke stage, `make serve`'s hint and the model card ask it on the
completions endpoint, and say so."""

import json
import shutil

import pytest

from eval import serve
from eval.serve import ServeError, Server, chat
from eval.vllm_run import VllmError
from quantize import runner
from quantize.export import serve_config
from tests.conftest import eval_main, tiny_recipe


def _without_chat_template(src, dst):
    """A copy of a tiny model whose tokenizer has no chat template (neither file nor tokenizer_config key)."""
    shutil.copytree(src, dst)
    for name in serve_config.CHAT_TEMPLATE_FILES:
        (dst / name).unlink(missing_ok=True)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def tiny_base(tiny_llama, tmp_path_factory):
    return _without_chat_template(tiny_llama, tmp_path_factory.mktemp("base") / "tiny-base")


def test_chat_template_found_where_transformers_keeps_it(tiny_llama, tiny_base, tmp_path):
    assert serve_config.endpoint(tiny_llama) == serve_config.CHAT  # chat_template.jinja
    assert serve_config.endpoint(tiny_base) == serve_config.COMPLETIONS
    in_config = _without_chat_template(tiny_base, tmp_path / "in-config")
    cfg = json.loads((in_config / "tokenizer_config.json").read_text())
    (in_config / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ messages }}"}))
    assert serve_config.endpoint(in_config) == serve_config.CHAT
    from transformers import AutoTokenizer

    for d, has in ((tiny_llama, True), (tiny_base, False), (in_config, True)):  # what transformers itself sees
        assert bool(AutoTokenizer.from_pretrained(d).chat_template) is has


def test_base_artifact_card_and_manifest_use_completions(tiny_llama, tiny_base, tmp_path):
    base = runner.run(tiny_recipe(tmp_path, tiny_base, name="base-rtn", method="rtn"), out_root=tmp_path / "a")
    chat_art = runner.run(tiny_recipe(tmp_path, tiny_llama, name="chat-rtn", method="rtn"), out_root=tmp_path / "a")
    for art, path in ((base, serve_config.COMPLETIONS), (chat_art, serve_config.CHAT)):
        assert json.loads((art / "manifest.json").read_text())["serve_endpoint"] == path
        card = (art / "README.md").read_text()
        assert f"curl -s http://localhost:8000{path} " in card and f"Then ask it on `{path}`, since the tokenizer" in card
    card = (base / "README.md").read_text()
    assert "has no chat template (a base model)" in card and '"prompt": "The capital of France is"' in card
    assert "/v1/chat/completions" not in card


def test_make_serve_hint_names_the_endpoint(tiny_base, monkeypatch, capsys):
    """`python -m eval.serve DIR` (make serve) prints a request on the endpoint the model answers on."""
    class Started:  # a server that has started and exited at once: main prints its hint, then reports the exit
        name, url, proc = "tiny-base", "http://127.0.0.1:8000", None

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(serve, "Server", Started)
    with pytest.raises(VllmError, match="vLLM's server exited"):  # the command line prints it as one error line
        serve.main([str(tiny_base)])
    out = capsys.readouterr().out
    assert "ask it on /v1/completions: the tokenizer has no chat template (a base model)" in out
    assert "curl -s http://127.0.0.1:8000/v1/completions" in out and '"prompt": "The capital of France is"' in out


@pytest.mark.vllm
@pytest.mark.vllm_no_4bit
def test_smoke_of_a_base_model_asks_on_completions(tiny_base):
    """A real vLLM server on a 16-bit tiny base model: its chat endpoint answers HTTP 400, and the smoke stage
    passes on the completions endpoint, recording which."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.smoke import TEXT_PROMPT, smoke

    with Server(tiny_base, {"served-model-name": "tiny-base", "dtype": "float16", "max-model-len": 256},
                timeout=400) as srv:
        with pytest.raises(ServeError, match="HTTP 400"):  # what a chat request to a base model gets
            chat(srv.url, "tiny-base", "Hello", max_tokens=4)
    res = smoke(tiny_base, lambda: AutoModelForCausalLM.from_pretrained(tiny_base, dtype="float32"),
                AutoTokenizer.from_pretrained(tiny_base), max_tokens=8, min_agreement=0.9)
    assert res["passed"], res["errors"]
    assert res["endpoint"] == serve_config.COMPLETIONS and res["checks"]["answers"] and res["checks"]["wrong_name_404"]
    assert res["answer"]["prompt"] == TEXT_PROMPT and res["answer"]["content"]
    assert "no chat template" in res["endpoint_why"]


@pytest.mark.vllm
def test_base_model_through_run_eval_register(tiny_base, tmp_path, monkeypatch, capsys):
    """The whole flow for a base model: quantize (AWQ 4-bit) and evaluate with the vLLM smoke stage, then
    register. Needs vLLM's 4-bit kernel (CUDA, or a CPU with AVX-512)."""
    why = serve.int4_kernel_missing()
    if why:
        pytest.skip(why)
    from pipeline import registry
    from pipeline.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'reg.db'}")
    recipe = tiny_recipe(tmp_path, tiny_base, name="tiny-base-awq",
                         eval=dict(perplexity=dict(dataset="wikitext2", seq_len=256, max_windows=4),
                                   vllm=dict(max_tokens=8, min_token_agreement=0.3)))
    assert main(["run", str(recipe), "--out", str(tmp_path / "a")]) == 0
    out = tmp_path / "a" / "tiny-base-awq"
    s = json.loads((out / "report.json").read_text())["vllm_smoke"]
    assert s["passed"] and s["endpoint"] == serve_config.COMPLETIONS, s
    assert "asked on `/v1/completions`" in (out / "report.md").read_text()
    assert eval_main([str(recipe), "--out", str(tmp_path / "a")]) == 0
    assert main(["register", str(recipe), "--out", str(tmp_path / "a")]) == 0  # a recipe path, as a user's own
    assert registry.versions("tiny-base-awq")[0]["metrics"]["vllm_smoke_passed"] == 1.0
