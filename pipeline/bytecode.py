"""Compiled bytecode for what a run imports, on hosts where Python would keep none.

A container image that sets PYTHONDONTWRITEBYTECODE and ships no bytecode (packages installed with `pip install
--no-compile`, or by uv, which compiles none unless asked) makes every process compile from source every module it
imports: a run imports about 4,000 (torch, transformers and what they pull in), in every process. `prepare()`,
called once at process start by the command line's entry point (`prepare_for`) before anything imports torch, points
Python at a bytecode cache of its own (`sys.pycache_prefix`: $QUANTIZE_CACHE_DIR/bytecode, or the
PYTHONPYCACHEPREFIX the user set), compiles the files named in imports.txt that have no bytecode there yet in worker
processes on every core at once, and lets the process (and the Python processes it starts: vLLM's server, the
kernel-selection child) write bytecode for anything else they import into the same cache, so that the next process
on the host finds it all. Nothing is written beside the installed sources. Where Python writes bytecode anyway (the
flag unset), or the installed packages carry theirs (pip compiles what it installs, flag or not), `prepare()` does
nothing. QUANTIZE_BYTECODE=off turns it off.

What it saves. The 2-core CPU box, its venv's bytecode hidden (a hard-linked copy without __pycache__):
`python -m pipeline preflight` of the default recipe 11.7 s a process without the cache, 5.0 s with it; a
`pipeline run` 13.6 s outside its quantize stage against 6.8 s. About 7 s saved in every process after the host's
first, which pays about 2 s more than without (it writes the cache, compiling as it imports: no workers below
MIN_CORES). An H200 image of this kind (16 cores; 4,162 listed files compiled in 1.6 s by the host's first
process): a 7B GPTQ run 26.5 s against 32.4-33.3 s, about 6 s a run. Where the packages carry their bytecode, as
pip leaves them, it saves nothing and costs 0.04 s of checking the list (docs/BENCHMARKS.md, "Process start:
deferred imports removed, the bytecode cache measured").

imports.txt lists source files relative to the sys.path entry that holds them (`torch/nn/modules/linear.py`,
`json/decoder.py`), as `bench/record_imports.py` records them from real runs; files a host does not have are
skipped, and a module the list lacks is compiled when it is imported, as Python would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.util import cache_from_source
from pathlib import Path

from filelock import FileLock

from quantize.errors import UserError
from quantize.files import usable_cores as _cores  # a name the tests may replace
from quantize.paths import cache_dir as quantize_cache_dir

LIST = Path(__file__).with_name("imports.txt")
# a worker compiles the (source, bytecode path) pairs it reads from stdin, one tab-separated pair a line
WORKER = r"""
import py_compile, sys
mode = py_compile.PycInvalidationMode.TIMESTAMP
opt = int(sys.argv[1])
for line in sys.stdin:
    src, cfile = line.rstrip("\n").split("\t")
    try:
        py_compile.compile(src, cfile=cfile, doraise=True, optimize=opt, invalidation_mode=mode)
    except Exception:
        pass  # a file that does not compile is compiled (and fails) where it is imported, as without a cache
"""
# QUANTIZE_BYTECODE's values (unset is on)
ON, OFF = ("", "on", "1", "true", "yes"), ("off", "0", "false", "no")
# commands that import no torch: a cache would cost them more than it saves
LIGHT = {"list", "validate"}
# what `prepare_for` did in this process, for the command line to log once logging is set up
PREPARED: "Prepared | None" = None
# below this many files a worker's start costs more than it saves
MIN_PER_WORKER = 64
# Where at least this share of the listed files has bytecode beside it, Python is left to read that: a cache would
# hide it and cost one compilation of everything. Images also ship part of it: one H200 image had bytecode for
# 2,113 of the 4,032 listed files it holds (its torch venv's, about half), and its processes compiled the rest
# from source every time.
BESIDE_ENOUGH = 0.95
# With fewer cores the workers compile the whole list in about the time a process takes to compile what it
# imports itself (2-core CPU box: 15.7 s for the list against 19-22 s for a whole pre-flight process that
# compiles as it imports), so there the process compiles as it imports, into the cache, and only the next one gains
MIN_CORES = 4


@dataclass
class Prepared:
    """What `prepare` did: the cache directory, the listed files compiled now, those found compiled, the workers."""
    prefix: Path
    compiled: int
    present: int
    workers: int
    seconds: float

    def line(self) -> str:
        return (f"bytecode cache {self.prefix}: {self.compiled} files compiled in {self.seconds:.1f} s by "
                f"{self.workers} processes, {self.present} already there")


def wanted() -> bool:
    """True where this process would otherwise compile every import from source and keep nothing (and
    QUANTIZE_BYTECODE does not say off); a value that is neither on nor off is the user's to fix."""
    value = os.environ.get("QUANTIZE_BYTECODE", "").strip().lower()
    if value not in ON + OFF:
        raise UserError(f"QUANTIZE_BYTECODE={os.environ['QUANTIZE_BYTECODE']!r} is neither on nor off: set it to "
                        f"off to leave Python's bytecode settings alone, or unset it")
    return value in ON and bool(sys.dont_write_bytecode)


def cache_dir() -> Path:
    if sys.pycache_prefix:
        return Path(sys.pycache_prefix)
    return quantize_cache_dir() / "bytecode"


def listed(names: list[str], roots: list[str] | None = None) -> list[str]:
    """Relative source paths -> the absolute paths of those that exist under the first sys.path entry holding
    their top-level name (as the import system would find the package)."""
    roots = [r or os.getcwd() for r in (roots if roots is not None else sys.path)]
    roots = [r for r in roots if os.path.isdir(r)]
    top_root: dict[str, str | None] = {}
    found = []
    for rel in names:
        top = rel.split("/", 1)[0]
        if top not in top_root:
            top_root[top] = next((r for r in roots if os.path.exists(os.path.join(r, top))), None)
        root = top_root[top]
        if root is not None:
            path = os.path.join(root, rel)
            if os.path.isfile(path):
                found.append(path)
    return found


def compile_all(pairs: list[tuple[str, str]], workers: int) -> None:
    """Compile (source, bytecode path) pairs in `workers` processes, each a share of about equal bytes."""
    shares: list[list[tuple[str, str]]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for pair in sorted(pairs, key=lambda p: -os.path.getsize(p[0])):
        i = loads.index(min(loads))
        shares[i].append(pair)
        loads[i] += os.path.getsize(pair[0])
    procs = []
    for share in shares:
        p = subprocess.Popen([sys.executable, "-I", "-c", WORKER, str(sys.flags.optimize)], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        procs.append((p, "".join(f"{s}\t{c}\n" for s, c in share)))
    for p, text in procs:
        p.stdin.write(text)
        p.stdin.close()
    for p, _ in procs:
        p.wait()


def prepare(names: list[str] | None = None) -> Prepared | None:
    """Point this process at the bytecode cache and fill it with the listed files' bytecode -> what was done, or
    None where nothing was wanted (Python writes bytecode itself, QUANTIZE_BYTECODE=off, or nearly all listed
    files already have bytecode where Python looks for it: `BESIDE_ENOUGH`) or the cache cannot be written; then
    the process runs as it would have. Once a cache is set, Python no longer reads bytecode beside the sources,
    hence that last check."""
    if not wanted():
        return None
    t0 = time.perf_counter()
    if names is None:
        names = LIST.read_text().split() if LIST.is_file() else []
    sources = listed(names)
    if sum(os.path.exists(cache_from_source(s)) for s in sources) >= BESIDE_ENOUGH * len(sources):
        return None  # the installed packages carry their bytecode (pip writes it at install): Python reads it there
    prefix = cache_dir()
    try:
        prefix.mkdir(parents=True, exist_ok=True)
        if not os.access(prefix, os.W_OK):
            return None
    except OSError:
        return None
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False  # what the process compiles itself lands in the cache too
    # and so does what its child processes import (vLLM's server and its kernel-selection child, workers)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    with FileLock(str(prefix / ".lock")):  # torchrun's ranks share one host: one of them compiles, the others wait
        pairs = [(s, cache_from_source(s)) for s in sources]
        missing = [(s, c) for s, c in pairs if not os.path.exists(c)]
        workers = min(_cores(), len(missing) // MIN_PER_WORKER) if _cores() >= MIN_CORES else 0
        workers = workers if workers >= 2 else 0  # one worker would only do what the process does as it imports
        if workers:
            compile_all(missing, workers)
    return Prepared(prefix, len(missing) if workers else 0, len(pairs) - len(missing), workers,
                    time.perf_counter() - t0)


def prepare_for(argv: list[str]) -> Prepared | None:
    """`prepare()` for a command line's arguments, unless its command imports no torch."""
    global PREPARED
    if argv and argv[0] not in LIGHT and not {"-h", "--help"} & set(argv):  # help, anywhere, imports no torch
        PREPARED = prepare()
    return PREPARED
