"""`make serve`'s server under load: many streamed requests, clients that hang up mid-stream, one over-long prompt.

    python bench/serve_load.py ARTIFACT [--requests 1000] [--concurrency 128] [--max-tokens 256] [--record NAME]

The server is started as `make serve` starts it (`python -m eval.serve ARTIFACT --port P` on 127.0.0.1, a free
port), in a process group this script owns (`eval.child`). Once /v1/models answers it sends, in order:
  1. N streamed completions at concurrency C (max_tokens, ignore_eos, temperature 0, a short prompt each),
     counting whole streams, tokens received and errors by kind;
  2. clients that open a stream and close it after a few chunks;
  3. one prompt longer than the served max-model-len (vLLM should answer HTTP 400);
  4. one ordinary request, which must still be answered.
The RSS of every process the server started (its process groups) is read before and after the load. The record
goes to bench/results/<record>.json and a table to stdout. A global deadline bounds the whole run; the server's
groups are stopped whatever happens, and the record says whether any of their processes was left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/serve_load.py` from anywhere
    sys.path.insert(0, str(ROOT))

from eval import child  # noqa: E402
from eval.serve import free_port  # noqa: E402
from quantize.preflight.deploy import vllm_version  # noqa: E402

HOST = "127.0.0.1"  # loopback only: the load never leaves this machine
WORDS = ("river stone market winter lantern copper garden signal harbor violet engine meadow thunder paper "
         "silver orchard").split()


# --- pure parts (tested without a server) ---------------------------------------------------------------------

def error_kind(status: int | None = None, exc: BaseException | None = None) -> str:
    """What went wrong with one request, as a key of the record's error counts: `http_<status>` for a refusal,
    the exception's class name for a transport failure, `incomplete_stream` for a stream that ended without
    [DONE]."""
    if exc is not None:
        return type(exc).__name__
    if status is not None:
        return f"http_{status}"
    return "incomplete_stream"


def _proc_fields(proc: Path, pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, VmRSS in kB) of one process from a /proc tree, or None if it vanished meanwhile."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after the last ')' are fixed
    rest = stat[stat.rindex(")") + 2:].split()
    ppid, pgid = int(rest[1]), int(rest[2])
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return ppid, pgid, rss  # kernel threads have no VmRSS line: 0


def process_table(proc: Path = Path("/proc")) -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgid, rss_kb) for every process readable under `proc`."""
    table = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and (fields := _proc_fields(proc, int(entry.name))) is not None:
            table[int(entry.name)] = fields
    return table


def server_groups(root: int, table: dict[int, tuple[int, int, int]]) -> set[int]:
    """The process groups of `root` and of everything it started: eval.serve leads one group, and the vLLM
    server it starts leads another (its own session), with the EngineCore and watchdog inside."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    groups, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            groups.add(table[pid][1])
            todo += children.get(pid, [])
    return groups


def group_rss_kb(groups: set[int], table: dict[int, tuple[int, int, int]]) -> tuple[int, int]:
    """(sum of VmRSS in kB, process count) over every process whose pgid is in `groups`."""
    members = [rss for _, pgid, rss in table.values() if pgid in groups]
    return sum(members), len(members)


def machine(cpuinfo: str) -> dict:
    """The CPU's model, core count and whether it has AVX-512 (which vLLM's CPU build needs for 4-bit)."""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return {"cpu": model, "cores": os.cpu_count(), "avx512": "avx512f" in flags}


# --- the load -------------------------------------------------------------------------------------------------

def prompt(rng: random.Random) -> str:
    """A short prompt that differs per request, so no two share a whole prefix-cache entry."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))


async def stream_one(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> tuple[str | None, int]:
    """One streamed completion -> (error kind or None, tokens received). The tokens are the server's own count
    (`stream_options.include_usage`: its last chunk carries `usage`), since one chunk may carry several tokens (the
    detokenizer holds back pieces of a character until it is whole). stop_after: close after that many chunks (a
    client that hangs up), which counts as success."""
    chunks, tokens = 0, None
    body = {**body, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return error_kind(status=r.status_code), 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return None, chunks if tokens is None else tokens
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"].get("completion_tokens")
                if not event.get("choices"):
                    continue
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return None, chunks  # leaving the block closes the connection mid-stream
        return error_kind(), chunks
    except (httpx.HTTPError, OSError, ValueError) as e:
        return error_kind(exc=e), chunks


async def load(client: httpx.AsyncClient, model: str, n: int, concurrency: int, max_tokens: int, seed: int,
               fig: dict) -> None:
    """Phase 1: n streamed requests, at most `concurrency` in flight; `fig` is updated as each one ends, so a
    global timeout still leaves the counts reached so far."""
    rng, sem = random.Random(seed), asyncio.Semaphore(concurrency)
    bodies = [{"model": model, "prompt": prompt(rng), "max_tokens": max_tokens, "stream": True,
               "ignore_eos": True, "temperature": 0} for _ in range(n)]
    fig.update({"requests": n, "concurrency": concurrency, "max_tokens": max_tokens, "completed": 0,
                "completed_short": 0, "errors": {}, "tokens": 0})
    t0 = time.perf_counter()

    async def one(body):
        async with sem:
            err, got = await stream_one(client, body)
        fig["tokens"] += got
        if err:
            fig["errors"][err] = fig["errors"].get(err, 0) + 1
        else:
            fig["completed"] += 1
            fig["completed_short"] += got < max_tokens
        wall = time.perf_counter() - t0
        fig["seconds"], fig["output_tok_s"] = round(wall, 1), round(fig["tokens"] / wall, 1)
    await asyncio.gather(*(one(b) for b in bodies))


async def disconnects(client: httpx.AsyncClient, model: str, n: int, after: int, max_tokens: int) -> dict:
    """Phase 2: n clients at once, each closing its stream after `after` chunks."""
    rng = random.Random(1)
    bodies = [{"model": model, "prompt": prompt(rng), "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
               "temperature": 0} for _ in range(n)]
    results = await asyncio.gather(*(stream_one(client, b, stop_after=after) for b in bodies))
    errors = Counter(err for err, _ in results if err)
    return {"clients": n, "closed_after_chunks": after, "closed_as_planned": sum(1 for err, _ in results if not err),
            "errors": dict(errors)}


async def over_length(client: httpx.AsyncClient, model: str, max_len: int) -> dict:
    """Phase 3: one prompt of more tokens than max-model-len ("go " is one token per word in common BPEs)."""
    body = {"model": model, "prompt": "go " * (max_len + 64), "max_tokens": 16, "temperature": 0}
    try:
        r = await client.post("/v1/completions", json=body)
    except (httpx.HTTPError, OSError) as e:
        return {"status": None, "error": error_kind(exc=e)}
    try:
        message = r.json().get("error", {}).get("message") or r.text
    except ValueError:
        message = r.text
    return {"status": r.status_code, "message": str(message)[:400]}


async def still_serving(client: httpx.AsyncClient, model: str) -> dict:
    """Phase 4: one ordinary request after everything else."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    try:
        r = await client.post("/v1/completions", json=body)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        return {"status": r.status_code, "answered": r.status_code == 200, "text": text}
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
        return {"status": None, "answered": False, "error": error_kind(exc=e)}


async def phases(url: str, a, out: dict) -> None:
    """Models, then the four phases in order, into `out`: what finished stays there when a later one fails or
    the global timeout cancels it."""
    limits = httpx.Limits(max_connections=a.concurrency + a.disconnects + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(a.request_timeout, connect=30)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        model, max_len = card["id"], int(card.get("max_model_len") or 0)
        out["model"], out["max_model_len"] = model, max_len
        out["load"] = {}
        await load(client, model, a.requests, a.concurrency, a.max_tokens, a.seed, out["load"])
        out["disconnects"] = await disconnects(client, model, a.disconnects, a.disconnect_after, a.max_tokens)
        out["over_length"] = await over_length(client, model, max_len)
        out["after"] = await still_serving(client, model)


# --- the server -----------------------------------------------------------------------------------------------

def start_server(artifact: Path, port: int, log: Path) -> subprocess.Popen:
    """`python -m eval.serve ARTIFACT --port P` as `make serve` runs it, in a group this process owns."""
    cmd = [sys.executable, "-m", "eval.serve", str(artifact), "--port", str(port), "--host", HOST]
    with open(log, "ab") as out:
        return child.start(cmd, {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")},
                           cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, url: str, deadline: float) -> float:
    """Seconds until /v1/models answers; RuntimeError if the server exits or the deadline passes first."""
    t0 = time.perf_counter()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return round(time.perf_counter() - t0, 1)
        time.sleep(1)
    raise RuntimeError("the server did not answer /v1/models before the deadline")


def stop_server(proc: subprocess.Popen, groups: set[int]) -> list[int]:
    """SIGINT to eval.serve (it stops vLLM itself, as Ctrl-C on `make serve` does), then SIGKILL to every group
    it had -> the pids still alive in those groups afterwards (should be none)."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    for pgid in groups | {proc.pid}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    child.release(proc)
    time.sleep(2)  # the kernel reaps the killed group's members
    table = process_table()
    return sorted(pid for pid, (_, pgid, _) in table.items() if pgid in groups | {proc.pid})


def rss(proc: subprocess.Popen) -> dict:
    """The server's process groups, their summed RSS (MiB) and process count, now."""
    table = process_table()
    groups = server_groups(proc.pid, table)
    kb, count = group_rss_kb(groups, table)
    return {"rss_mib": round(kb / 1024, 1), "processes": count, "groups": sorted(groups)}


def run(a) -> dict:
    """Start the server, run the phases under the global deadline, stop the server -> the record."""
    deadline = time.monotonic() + a.timeout
    port = free_port(HOST)
    url = f"http://{HOST}:{port}"
    log = ROOT / "bench" / "results" / f"{a.record}.server.log" if a.keep_log else Path(f"/tmp/serve-load-{port}.log")
    rec = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(Path("/proc/cpuinfo").read_text()), "artifact": str(a.artifact),
           "vllm": vllm_version(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "server_command": f"python -m eval.serve {a.artifact} --port {port} --host {HOST}"}
    proc = start_server(a.artifact, port, log)
    groups: set[int] = {proc.pid}
    try:
        rec["ready_s"] = wait_ready(proc, url, deadline)
        before = rss(proc)
        groups |= set(before["groups"])
        rec["rss_before"] = before
        left = deadline - time.monotonic()
        try:
            asyncio.run(asyncio.wait_for(phases(url, a, rec), timeout=left))
        except asyncio.TimeoutError:
            rec["timed_out"] = f"the global timeout ({a.timeout} s) passed during the load"
        after = rss(proc)
        groups |= set(after["groups"])
        rec["rss_after"] = after
        rec["server_alive_after"] = proc.poll() is None
    except Exception as e:  # the record still says how far it got, and the server is still stopped
        rec["failed"] = f"{type(e).__name__}: {e}"
    finally:
        rec["left_running"] = stop_server(proc, groups)
    rec["server_log_tail"] = log.read_text(errors="replace")[-1500:] if log.is_file() else ""
    return rec


def table(rec: dict) -> str:
    """The record's figures, one line each."""
    ld, dc, ol, af = (rec.get(k, {}) for k in ("load", "disconnects", "over_length", "after"))
    rows = [("machine", f"{rec['machine']['cpu']}, {rec['machine']['cores']} cores, "
                        f"AVX-512 {'yes' if rec['machine']['avx512'] else 'no'}; vLLM {rec['vllm']}"),
            ("requests (concurrency, max_tokens)", f"{ld.get('requests')} ({ld.get('concurrency')}, "
                                                   f"{ld.get('max_tokens')})"),
            ("streams completed", ld.get("completed")), ("errors by kind", ld.get("errors")),
            ("tokens received", ld.get("tokens")), ("load seconds", ld.get("seconds")),
            ("output tok/s", ld.get("output_tok_s")),
            ("disconnecting clients closed as planned", f"{dc.get('closed_as_planned')}/{dc.get('clients')} "
                                                        f"errors {dc.get('errors')}"),
            ("over max-model-len", f"HTTP {ol.get('status')}: {ol.get('message', ol.get('error'))}"),
            ("answered afterwards", f"{af.get('answered')} (HTTP {af.get('status')})"),
            ("server RSS before / after (MiB)", f"{rec.get('rss_before', {}).get('rss_mib')} / "
                                                f"{rec.get('rss_after', {}).get('rss_mib')}"),
            ("processes left after stop", rec.get("left_running"))]
    rows += [("failed", rec["failed"])] if "failed" in rec else []
    rows += [("timed out", rec["timed_out"])] if "timed_out" in rec else []
    return "\n".join(f"{k:<42} {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--disconnects", type=int, default=50, help="clients that hang up mid-stream (default 50)")
    ap.add_argument("--disconnect-after", type=int, default=4, help="chunks each reads before hanging up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600, help="global deadline in seconds, start-up included")
    ap.add_argument("--request-timeout", type=float, default=1200, help="per request (read gaps), seconds")
    ap.add_argument("--record", default=None, help="name under bench/results/ (default serve-load-<cpu|gpu>-DATE)")
    ap.add_argument("--keep-log", action="store_true", help="keep the server's log beside the record")
    a = ap.parse_args(argv)
    a.artifact = a.artifact.resolve()
    a.record = a.record or f"serve-load-{dt.date.today().isoformat()}"
    rec = run(a)
    path = ROOT / "bench" / "results" / f"{a.record}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(table(rec))
    print(f"record: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")  # --record may be a path
    ok = (rec.get("after", {}).get("answered") and not rec.get("left_running") and "failed" not in rec
          and "timed_out" not in rec)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
