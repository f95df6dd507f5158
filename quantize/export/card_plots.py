"""The figures the model card links: each linear's output error over depth (output-error.png) and, for a mixture
of experts, the routed calibration tokens per expert (experts.png). Drawn with matplotlib's Figure (Agg, no pyplot)
from the manifest's records, with no version stamp, so the same record gives the same bytes; absent without the
`plots` extra.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

from ..methods import output_error
from ..records import Manifest

log = logging.getLogger(__name__)


ERROR_PLOT = "output-error.png"  # each linear's relative output error over depth, linked from the card


def plot_errors(manifest: Manifest | dict, path: Path) -> bool:
    """The manifest's per-linear output errors (`quantize.methods.output_error`) over depth, a line per linear name,
    written to `path` -> whether it was drawn (not for a manifest without them, or without matplotlib)."""
    m = Manifest.of(manifest)
    png = error_plot(m.artifact, m.output_error or {}, path.name)
    if png is not None:
        path.write_bytes(png)
    return png is not None


def error_plot(artifact: str, errors: dict, name: str = ERROR_PLOT) -> bytes | None:
    """`plot_errors`' PNG as bytes, from an artifact's name and its `output_error` record -> None without errors or
    without matplotlib. Needs no artifact directory and no pyplot state: export draws it in a thread while the
    weights are packed and written (`export.artifact`)."""
    curves = output_error.by_depth(errors)
    if not curves:
        return None
    Figure = _figure(name, "errors")
    if Figure is None:
        return None
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for linear, pts in curves.items():
        ax.plot([i for i, _ in pts], [e for _, e in pts], marker=".", label=linear)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("relative output error ||X(W-Q)ᵀ|| / ||XWᵀ||")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{artifact}: quantization error of each linear on its calibration inputs", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})  # no version stamp: same errors, same bytes
    return buf.getvalue()


EXPERT_PLOT = "experts.png"  # a MoE artifact's heatmap of routed calibration tokens, linked from the card


def plot_experts(manifest: Manifest | dict, path: Path) -> list[list[int]] | None:
    """A MoE manifest's routed calibration tokens as a heatmap (a row per layer, a column per expert; a cross
    marks an expert under `moe.min_expert_tokens`, calibrated on all tokens) written to `path` -> the matrix
    drawn; None for a dense model, or when matplotlib (the `plots` extra) is not installed."""
    m = Manifest.of(manifest)
    layers = m.expert_layers()
    if not layers:
        return None
    Figure = _figure(path.name, "counts")
    if Figure is None:
        return None
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    matrix = [list(e.routed_tokens) for _, e in layers]
    n_layers, n_exp = len(matrix), max(len(r) for r in matrix)
    fig = Figure(figsize=(min(16.0, max(6.0, 3.0 + 0.1 * n_exp)), min(12.0, max(3.5, 2.0 + 0.22 * n_layers))))
    ax = fig.subplots()
    cmap = colormaps["viridis"].with_extremes(bad="white")  # no token: a log scale has no place for 0
    # a log scale: a router's favourites take many times the median, which a linear scale would flatten
    im = ax.imshow(matrix, aspect="auto", cmap=cmap, interpolation="nearest",
                   norm=LogNorm(vmin=min((x for r in matrix for x in r if x > 0), default=1),
                                vmax=max(2, max(max(r) for r in matrix))))
    under = [(e, row) for row, (_, rec) in enumerate(layers) for e in rec.calibrated_on_all_tokens]
    if under:
        ax.scatter([e for e, _ in under], [r for _, r in under], marker="x", s=18, color="tab:red")
    if n_exp <= 32:
        ax.set_xticks(range(n_exp))
    if n_layers <= 48:  # beyond that the default ticks (row = layer index) stay readable
        ax.set_yticks(range(n_layers), [str(i) for i, _ in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, label="routed calibration tokens (white: none)")
    ax.set_title(f"Calibration tokens the router sent each expert, of {layers[0][1].tokens} per layer\n"
                 f"x: under {layers[0][1].min_expert_tokens} (moe.min_expert_tokens), calibrated on all tokens",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})  # no version stamp: the same counts, the same bytes
    return matrix


def _figure(name: str, what: str):
    """matplotlib's Figure class (drawn by Agg when saved; no pyplot, whose figure registry is shared by threads), or
    None (with a warning naming the plot) without the `plots` extra."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("matplotlib is not installed: no %s (the %s are in manifest.json)", name, what)
        return None
    return Figure
