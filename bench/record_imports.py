"""Record the source files a command imports, for pipeline/imports.txt (the bytecode cache's list).

    python bench/record_imports.py --merge pipeline/imports.txt -- run smollm2-rtn-g64 --out /tmp/rec --force
    python bench/record_imports.py --merge pipeline/imports.txt --script bench/bench_ours.py -- RECIPE.yaml ...

Runs `python -m pipeline <args>` (or the given script) in this process, then writes every imported module's
source file relative to the sys.path entry that holds it, sorted, merged with the file given to --merge. Files
of child processes (vLLM's server, workers) are not seen; a host records what its runs import (a CUDA run
imports Triton's compiler, a CPU run does not), and the lists merge.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_files() -> set[str]:
    """sys.modules (but this repository's bench scripts, which no installed command runs) -> their .py sources as
    paths relative to the sys.path entry the import found them under, read off the module's dotted name: `a.b` ->
    a/b.py or a/b/__init__.py."""
    out = set()
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not f or not f.endswith(".py") or name == "__main__" or name.split(".")[0] == "bench":
            continue
        parts = name.split(".")
        rel = "/".join(parts) + ("/__init__.py" if os.path.basename(f) == "__init__.py" else ".py")
        if f.replace(os.sep, "/").endswith("/" + rel):  # aliases (os.path -> posixpath) are recorded as themselves
            out.add(rel)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--merge", type=Path, required=True, help="list to merge into (written back)")
    ap.add_argument("--script", type=Path, help="run this script instead of `python -m pipeline`")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = a.args[1:] if a.args[:1] == ["--"] else a.args
    sys.path.insert(0, str(ROOT))
    code = 0
    try:
        if a.script:
            sys.argv = [str(a.script), *argv]
            runpy.run_path(str(a.script), run_name="__main__")
        else:
            sys.argv = ["pipeline", *argv]
            runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    have = set(a.merge.read_text().split()) if a.merge.is_file() else set()
    new = imported_files()
    a.merge.write_text("".join(f"{n}\n" for n in sorted(have | new)))
    print(f"{len(new)} files imported, {len(new - have)} new; {len(have | new)} in {a.merge}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
