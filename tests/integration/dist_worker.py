"""torchrun entry for tests/integration/test_distributed.py: the `quantize` CLI, with one fault injected on one
rank when DIST_TEST_FAIL names it ("RANK:where", where: "unit" - inside a unit of work the owner computes and
broadcasts (an AWQ clip search), "layer" - in the second decoder layer before any collective of that layer).

Run as a file (`torchrun ... tests/integration/dist_worker.py run RECIPE ...`), so nothing in the package knows
about faults.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline import cli  # noqa: E402
from quantize.methods import awq_grid  # noqa: E402
from quantize.methods import awq_layer  # noqa: E402
from quantize.capture.loop import NumericalError  # noqa: E402

MESSAGE = "injected failure on this rank"


def _inject(where: str) -> None:
    if where == "unit":
        def failing_clip(*args, **kwargs):
            raise NumericalError(f"clip search: {MESSAGE}")
        awq_grid.search_clip = failing_clip
    elif where == "layer":
        original = awq_layer.awq_layer

        def failing_layer(data, *args, **kwargs):
            if data.index == 1:
                raise NumericalError(f"decoder layer 2: {MESSAGE}")
            return original(data, *args, **kwargs)
        awq_layer.awq_layer = failing_layer
    else:
        raise SystemExit(f"DIST_TEST_FAIL: unknown place {where!r}")


if __name__ == "__main__":
    fail = os.environ.get("DIST_TEST_FAIL")
    if fail:
        rank, where = fail.split(":")
        if os.environ["RANK"] == rank:
            _inject(where)
    sys.exit(cli.main(sys.argv[1:]))
