"""`python -m pipeline` and the `quantize` command. The bytecode cache is prepared before the command line's own
imports (pydantic, yaml) and long before torch's (`pipeline.bytecode`); the process ends without tearing every
module down (`exit_now`)."""

import atexit
import os
import sys
import threading
from typing import NoReturn

from quantize.errors import UserError

from . import bytecode


def main(argv: list[str] | None = None) -> int:
    try:
        bytecode.prepare_for(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # before the command line exists, so answered here the way it answers
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .cli import main as cli_main

    return cli_main(argv)


def run() -> NoReturn:
    """The command as a process: `main`, then `exit_now` with its exit status. A reader of its output that goes
    away early (`quantize list | head -1`) ends it quietly, as a closed pipe ends other commands (status 141)."""
    try:
        code = main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
        code = 141
    exit_now(code)


def exit_now(code: int | None) -> NoReturn:
    """End the process with `code` the way the interpreter's own exit begins (other threads finished and joined,
    exit handlers run: logging's, filelock's, multiprocessing's, ...; output flushed), then skip the rest: tearing
    down each of the thousands of modules a command imports (torch, transformers) writes nothing and costs
    every command close to a second (docs/BENCHMARKS.md, "A process's fixed costs"). Every file this
    tool writes is closed, and an artifact sealed, before its command returns. Under a profiler, tracer or
    debugger (`python -m cProfile -m pipeline ...`, coverage), which write their results once the command
    returns, and where this Python lacks either step's function, the interpreter exits as usual."""
    shutdown, run_handlers = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_handlers is None or sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    shutdown()  # what multiprocessing's children run before their own os._exit, in this order
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to deliver
            pass
    os._exit(0 if code is None else code)


if __name__ == "__main__":
    run()
