"""Helpers for the registry tests that run `register` as separate processes, as CI jobs run it."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
MODEL = "shared"  # every writer adds a version to this one registered model: the numbers race
LOOPBACK = "127.0.0.1,localhost"


def registry_env(uri: str) -> dict[str, str]:
    """This environment with the registry at `uri` (no other MLFLOW_* setting) and no proxy for the loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**env, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
            "NO_PROXY": LOOPBACK, "no_proxy": LOOPBACK}


def register_at_once(artifact: Path, n: int, work: Path, uri: str, timeout: float = 300) -> list[int]:
    """`python -m pipeline register` on n copies of `artifact` (n CI jobs have n checkouts), all started before
    any is waited for -> the version numbers they printed. Fails on any error exit."""
    copies = [shutil.copytree(artifact, work / f"job{i}" / "writer") for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline", "register", "--artifact", str(c), "--name", MODEL],
                              cwd=ROOT, env=registry_env(uri), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in copies]
    deadline, results = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"exit {rc}: {err.strip()[-600:]}" for rc, _, err in results if rc != 0]
    assert not failed, f"{len(failed)} of {n} writers failed:\n" + "\n".join(failed)
    assert not any("database is locked" in err for _, _, err in results)
    return [int(out.split(f"registered {MODEL} version ")[1].split()[0]) for _, out, _ in results]


def listed(monkeypatch, capsys, uri: str) -> list[dict]:
    """`python -m pipeline registry --json` (in this process) on the registry at `uri` -> its rows."""
    for k, v in registry_env(uri).items():
        if k.startswith("MLFLOW_") or k.lower() == "no_proxy":
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    capsys.readouterr()
    assert cli_main(["registry", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def tree(d: Path) -> dict[str, bytes]:
    """Every file under `d` -> its bytes, by path relative to `d`."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}
