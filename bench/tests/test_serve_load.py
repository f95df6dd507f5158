"""bench/serve_load.py's pure parts: the RSS summed over the server's process groups, read from a fake /proc,
the error kinds its record counts, and the tokens a stream counts (the server's usage, not its chunks)."""

from __future__ import annotations

import asyncio
import json

import httpx

from bench.serve_load import error_kind, stream_one, group_rss_kb, machine, process_table, server_groups


def fake_proc(root, procs):
    """procs: pid -> (comm, ppid, pgid, rss_kb or None) written as /proc/<pid>/stat and status."""
    for pid, (comm, ppid, pgid, rss) in procs.items():
        d = root / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pgid} {pgid} 0 -1 4194560 0 0 0 0\n")
        (d / "status").write_text(f"Name:\t{comm}\nPid:\t{pid}\n" + (f"VmRSS:\t{rss} kB\n" if rss is not None else ""))
    (root / "self").mkdir()  # non-numeric entries are not processes
    return root


def test_rss_sums_every_group_the_server_started_and_nothing_else(tmp_path):
    proc = fake_proc(tmp_path, {
        100: ("python", 1, 100, 50_000),          # eval.serve, leader of the group this script owns
        101: ("python", 100, 100, 1_000),         # its watchdog
        200: ("python", 100, 200, 300_000),       # the vLLM server: a session and group of its own
        201: ("VLLM::Engine Core", 200, 200, 2_000_000),  # spaces and ':' in the name; after a fork
        202: ("python", 201, 200, 500),
        300: ("python", 1, 300, 9_999_999),       # another user's vLLM on the same box
        301: ("kworker) (x", 2, 0, None),         # a kernel thread: a ')' in its name, no VmRSS
    })
    table = process_table(proc)
    assert table[201] == (200, 200, 2_000_000) and table[301] == (2, 0, 0)
    groups = server_groups(100, table)
    assert groups == {100, 200}
    assert group_rss_kb(groups, table) == (50_000 + 1_000 + 300_000 + 2_000_000 + 500, 5)


def test_a_process_that_vanishes_while_read_is_skipped(tmp_path):
    proc = fake_proc(tmp_path, {100: ("python", 1, 100, 10)})
    (proc / "101").mkdir()  # listed, but its files are gone (it exited between listdir and read)
    assert process_table(proc) == {100: (1, 100, 10)}
    assert server_groups(999, process_table(proc)) == set()  # a root that has exited: nothing to measure


def test_error_kinds():
    assert error_kind(status=400) == "http_400"
    assert error_kind(status=503) == "http_503"
    assert error_kind(exc=httpx.ReadTimeout("slow")) == "ReadTimeout"
    assert error_kind(exc=httpx.RemoteProtocolError("peer closed")) == "RemoteProtocolError"
    assert error_kind(exc=ConnectionResetError()) == "ConnectionResetError"
    assert error_kind() == "incomplete_stream"  # a 200 stream that ended without [DONE]


def test_machine_reads_the_cpu_and_avx512():
    info = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
    assert machine(info)["cpu"] == "AMD EPYC 9R14" and machine(info)["avx512"] is True
    assert machine(info.replace(" avx512f avx512bw", ""))["avx512"] is False


def _stream(texts, usage):
    """A vLLM-like completions stream: one chunk per text, then the usage chunk, then [DONE]."""
    events = [{"choices": [{"text": t, "index": 0}]} for t in texts] + [{"choices": [], "usage": usage}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, text=body)
    return httpx.MockTransport(handler), seen


def test_tokens_are_the_servers_count_where_a_chunk_holds_several():
    transport, seen = _stream(["a", "\u00e9", "b"], {"completion_tokens": 4, "prompt_tokens": 3})

    async def go(**kw):
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            return await stream_one(c, {"model": "m", "prompt": "p", "max_tokens": 4, "stream": True}, **kw)
    assert asyncio.run(go()) == (None, 4)  # 3 chunks, 4 tokens: the usage decides
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert asyncio.run(go(stop_after=2)) == (None, 2)  # a client hanging up counts the chunks it read
