"""Two artifacts of one model and format, tensor by tensor: how many elements differ per tensor kind, and the
manifests' per-linear relative output errors side by side (what a change of search kernel moved, and by how much).

    python bench/diff_artifacts.py A B [--json OUT.json]

Tensor kinds are the last part of a tensor's name (`qweight`, `qzeros`, `scales`, `weight`, ...); packed kinds
count packed words (eight 4-bit codes in one int32). Both artifacts must hold the same tensor names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantize import manifest  # noqa: E402


def _where(root: Path) -> dict[str, Path]:
    """artifact directory -> tensor name -> the shard holding it."""
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: f for k in st.keys()})
    return out


class NotComparable(ValueError):
    """The two directories cannot be compared tensor by tensor (the message says why and what to pass)."""


def diff(a: Path, b: Path) -> dict:
    """-> {"tensors": kind -> {"elements", "differ", "share"}, "output_error": {"mean": [a, b], "max": [a, b]}}."""
    wa, wb = _where(a), _where(b)
    for root, where in ((a, wa), (b, wb)):
        if not where:
            raise NotComparable(f"{root} holds no .safetensors file; pass two artifact directories")
    if wa.keys() != wb.keys():
        raise NotComparable(f"{a} and {b} hold different tensors ({len(wa)} against {len(wb)} names); compare "
                            f"two artifacts of one model and format")
    kinds: dict[str, list[int]] = {}
    for name in sorted(wa):
        with safe_open(str(wa[name]), "pt") as x, safe_open(str(wb[name]), "pt") as y:
            u, v = x.get_tensor(name), y.get_tensor(name)
        n = kinds.setdefault(name.rsplit(".", 1)[-1], [0, 0])
        n[0] += u.numel()
        n[1] += int((u != v).sum()) if u.shape == v.shape else u.numel()
    errors = [[e for per in (m.output_error or {}).values() for e in per.values()]
              for m in (manifest.read(a), manifest.read(b)) if m is not None]
    return {"tensors": {k: {"elements": n, "differ": d, "share": d / n if n else 0.0} for k, (n, d) in kinds.items()},
            "output_error": {"mean": [sum(e) / len(e) for e in errors], "max": [max(e) for e in errors]}
            if len(errors) == 2 and all(errors) else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    try:
        out = diff(args.a, args.b)
    except NotComparable as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
