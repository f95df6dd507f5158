"""The installed version of each named package, for a benchmark's run record ("absent" where not installed).

Kept free of heavy imports: the peer scripts read it before they know whether llm-compressor is there."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def installed(packages: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for p in packages:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "absent"
    return out
