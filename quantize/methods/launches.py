"""The Triton launches a run's methods will need, from the recipes and the model's config alone: `warmup` compiles
them in a side process while the run starts. Apart from `kernels` (which the layer jobs import) because it reads the
method registry, which imports those jobs."""

from __future__ import annotations

import json

from . import get
from ..source.linears import linear_shapes


def plan(recipes, config, arch, compute_dtype) -> list[dict]:
    """The launches, in the order the pass first needs them (recipe by recipe, each method's kernels in its order,
    `Method.triton_kernels`) -> [{module, group, rows, cols, dtype, and the method's settings}].

    Triton compiles one kernel per dtype, constant and class of each integer argument (1, a multiple of 16, or
    neither), so a few rows stand for a linear's output count: 16 where it is a multiple of 16, else 16 plus its
    remainder; cols: the real input counts, which fix the sweeps' blocks and group counts."""
    shapes = linear_shapes(arch, config)  # {local name: (in, out)}
    dims = {(16 + o % 16, i) for i, o in shapes.values()}
    for fused in arch.fused:  # linears one problem stacks by rows (GPTQ's q/k/v, gate/up)
        if all(n in shapes for n in fused):
            dims.add((16 + sum(shapes[n][1] for n in fused) % 16, shapes[fused[0]][0]))
    dtype = str(compute_dtype).removeprefix("torch.")
    out, seen = [], set()
    for r in recipes:
        for use in get(r.method).triton_kernels(r):
            for rows, cols in sorted(dims):
                launch = {**use, "rows": rows, "cols": cols, "dtype": dtype}
                frozen = json.dumps(launch, sort_keys=True)
                if frozen not in seen:
                    seen.add(frozen)
                    out.append(launch)
    return out
