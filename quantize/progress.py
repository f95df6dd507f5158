"""Progress of the long loops (decoder layers, eval windows): a tqdm bar when stderr is a terminal, one log line
per step otherwise (CI logs and files keep every step, with its numbers)."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm


class Progress:
    """`step(line, short)` once per unit of work: the bar advances showing `short`, or `line` is logged."""

    def __init__(self, total: int, desc: str, log: logging.Logger, unit: str, start: int = 0):
        self.log = log
        self.bar = tqdm(total=total, initial=start, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                        leave=True) if sys.stderr.isatty() else None

    def step(self, line: str, short: str = "") -> None:
        if self.bar is None:
            self.log.info("%s", line)
        else:
            self.bar.set_postfix_str(short, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
