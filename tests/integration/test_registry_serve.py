"""From a comparison to a served registry version: compare -> register the variants as versions of one model
(group size as a tag) with an alias on the chosen one -> `serve models:/<name>@<alias>` fetches it through
MLflow, verifies its manifest and starts vLLM's server on it (`python -m pipeline serve`, what `make serve` runs).

On a CPU whose vLLM build has no 4-bit kernel (AVX2 only) the eval's vLLM smoke is skipped, and the registry
refuses artifacts vLLM never loaded: there, and only there, this test lifts that one gate (`never_loaded`) so
that the rest of the path runs for real; the server still starts on the 4-bit files and answers /v1/models
(its first completion would fail on such a CPU, so none is asked for). Elsewhere nothing is lifted and a chat
completion is asked for too.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eval.serve import chat, free_port, int4_kernel_missing, served_models
from pipeline import registry
from pipeline.cli import main as cli_main
from tests.conftest import tiny_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_no_4bit]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sqlite_registry(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'reg.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    return uri


@pytest.fixture
def compared(tiny_llama, tmp_path, monkeypatch):
    """A two-variant round-to-nearest sweep (g32, g64), compared and evaluated -> the artifacts' parent."""
    recipe = tiny_recipe(tmp_path, tiny_llama, name="tiny-rs", method="rtn", sweep={"q_group_size": [32, 64]},
                         eval=dict(perplexity=dict(dataset="wikitext2", seq_len=128, max_windows=2),
                                   vllm=dict(max_tokens=8, min_token_agreement=0.3)))
    out = tmp_path / "a"
    assert cli_main(["compare", str(recipe), "--out", str(out)]) == 0
    if int4_kernel_missing():
        for variant in ("tiny-rs-g32", "tiny-rs-g64"):  # the eval said why it skipped the smoke
            assert "skipped" in json.loads((out / variant / "report.json").read_text())["vllm_smoke"]
        monkeypatch.setattr(registry, "never_loaded", lambda report: None)
    return out


def test_register_alias_then_serve_the_registered_version(compared, sqlite_registry, tmp_path, capsys):
    out = compared
    assert cli_main(["register", "--comparison", "tiny-rs", "--out", str(out), "--alias", "champion",
                     "--variant", "tiny-rs-g64"]) == 0
    printed = capsys.readouterr().out
    assert "registered tiny-rs version 2 (tiny-rs-g64, group size 64, alias @champion)" in printed, printed
    rows = registry.versions("tiny-rs")
    assert [(r["version"], r["tags"]["variant"], r["tags"]["group_size"], r["aliases"]) for r in rows] == [
        (2, "tiny-rs-g64", "64", ["champion"]), (1, "tiny-rs-g32", "32", [])]

    # resolution and verification, no server: the command make serve would run
    assert cli_main(["serve", "models:/tiny-rs@champion", "--out", str(out), "--dry-run", "--port", "8123"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("models:/tiny-rs@champion: ") and lines[0].endswith("(manifest verified)")
    cmd = lines[1]
    assert "-m eval.vllm_server --model" in cmd and "vllm-serve.yaml" in cmd
    assert "--port 8123" in cmd and "--host 127.0.0.1" in cmd
    assert not list(out.glob(".serve-registry-*"))  # the fetched copy is gone

    # the registered copies altered behind the registry's back: refused, naming the file
    stored = list(Path(sqlite_registry.removeprefix("sqlite:///")).parent.joinpath("artifacts").rglob(
        "model/config.json"))
    assert len(stored) == 2
    saved = [f.read_bytes() for f in stored]
    for f in stored:
        f.write_bytes(f.read_bytes() + b" ")
    try:
        assert cli_main(["serve", "models:/tiny-rs@champion", "--out", str(out), "--dry-run"]) == 2
        assert "config.json (sha256 differs from the manifest)" in capsys.readouterr().err
    finally:
        for f, data in zip(stored, saved):
            f.write_bytes(data)
    assert not list(out.glob(".serve-registry-*"))
    for bad, needle in (("models:/tiny-rs@nobody", "has no alias @nobody; its aliases: ['champion']"),
                        ("models:/tiny-sr@champion", "no registered model 'tiny-sr'"),
                        ("models:/tiny-rs/7", "has no version 7")):
        assert cli_main(["serve", bad, "--out", str(out), "--dry-run"]) == 2
        assert needle in capsys.readouterr().err

    # the real server, started as make serve starts it, on the version the alias names
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "models:/tiny-rs@champion", "--out",
                             str(out), "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        names, t0 = None, time.monotonic()
        while names is None and time.monotonic() - t0 < 600 and proc.poll() is None:
            try:
                names = served_models(url)
            except httpx.HTTPError:
                time.sleep(1)
        assert names == ["tiny-rs-g64"], proc.stdout.read() if proc.poll() is not None else names
        if not int4_kernel_missing():
            assert chat(url, "tiny-rs-g64", "Hello", max_tokens=4)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            text = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text = proc.communicate()[0]
    assert proc.returncode == 0, text[-3000:]
    assert "models:/tiny-rs@champion: " in text and "(manifest verified)" in text and "stopped" in text
    assert not list(out.glob(".serve-registry-*"))


def test_the_registry_ui_serves_a_registered_versions_metrics_over_http(compared, sqlite_registry, tmp_path):
    """`make registry-ui` (`python -m pipeline registry --ui`): MLflow's own server on the registry's SQLite file
    serves its web UI, and its REST API gives a registered version's run with the eval's KL and top-1."""
    assert cli_main(["register", "--comparison", "tiny-rs", "--out", str(compared)]) == 0
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "registry", "--ui", "--port", str(port)], cwd=ROOT,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the MLflow UI did not answer within 180 s"
            time.sleep(1)
        page = httpx.get(f"{base}/", timeout=30)
        assert page.status_code == 200 and "<title>MLflow</title>" in page.text
        found = httpx.get(f"{base}/api/2.0/mlflow/model-versions/search", params={"filter": "name='tiny-rs'"},
                          timeout=30).json()["model_versions"]
        assert sorted(v["version"] for v in found) == ["1", "2"]
        for v in found:
            run = httpx.get(f"{base}/api/2.0/mlflow/runs/get", params={"run_id": v["run_id"]}, timeout=30).json()
            metrics = {m["key"]: m["value"] for m in run["run"]["data"]["metrics"]}
            variant = next(t["value"] for t in v["tags"] if t["key"] == "variant")
            dist = json.loads((compared / variant / "report.json").read_text())["distribution"]
            assert metrics["kl_mean"] == pytest.approx(dist["kl_mean"]) and metrics["top1"] == pytest.approx(dist["top1"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
