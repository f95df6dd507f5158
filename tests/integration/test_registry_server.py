"""The registry a team shares: a real `mlflow server` process on the loopback (a SQLite file behind it, as a
PostgreSQL or MySQL database would be), two `register` jobs at once through MLFLOW_TRACKING_URI=http://..., then
`registry` lists both and a version resolves through the server. The server and all its workers are stopped."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from eval.serve import free_port
from pipeline import registry
from tests.integration.registry_jobs import MODEL, listed, register_at_once, registry_env, tree

HOST = "127.0.0.1"  # loopback only


def group_alive(pgid: int) -> list[int]:
    """Processes of group `pgid` that are still running (zombies waiting to be reaped do not count)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def start_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port(HOST)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp / 'server.db'}",
           "--artifacts-destination", str(tmp / "server-artifacts"), "--host", HOST, "--port", str(port),
           "--workers", "1"]
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=registry_env(""))
    url, deadline = f"http://{HOST}:{port}", time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "mlflow server not up in 120 s:\n" + (tmp / "server.log").read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s; returns once nothing of the group runs."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = group_alive(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"mlflow server left processes {left} running"


def test_register_list_and_resolve_through_a_tracking_server(registrable_artifact, tmp_path, monkeypatch, capsys):
    server, url = start_server(tmp_path)
    try:
        assert sorted(register_at_once(registrable_artifact, 2, tmp_path / "jobs", url)) == [1, 2]
        rows = listed(monkeypatch, capsys, url)
        assert sorted(r["version"] for r in rows if r["name"] == MODEL) == [1, 2]
        assert all(r["source"].startswith("mlflow-artifacts:") for r in rows)  # uploaded to the server
        assert not (tmp_path / "jobs" / "reg").exists()  # no SQLite file beside the jobs
        local = registry.resolve(f"models:/{MODEL}/2", tmp_path / "serve")
        assert tree(local) == tree(registrable_artifact)
    finally:
        stop_server(server)
    assert server.returncode is not None
