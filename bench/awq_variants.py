"""AWQ variants that differ only after the scale search (clip, scale refit, rounding), quantized in one pass.

    python bench/awq_variants.py smollm2-awq-g64 --out /tmp/art \
        base: rps: awq.clip_search=per_side,awq.refit_iters=2 gptq: awq.rounding=gptq ...

Each variant is `name:` followed by comma-separated dotted recipe keys overriding the base recipe; the
artifacts are written as `<out>/<base>-<name>`. The pass is `runner.run_many`'s (one load, one calibration,
every variant on its own copy of each layer); the scale search, which every variant would repeat on the same
unmodified layer and inputs, runs once per layer and scale group and is handed to the others (exact: the
search's inputs are identical). Records each variant's quantize seconds in its manifest as usual.
"""

from __future__ import annotations

import argparse
import logging

import yaml

from quantize import recipe as recipe_mod, runner
from quantize.recipe.load import _set_dotted
from quantize.methods import awq_layer


def variant(base: recipe_mod.Recipe, label: str, overrides: str) -> recipe_mod.Recipe:
    """base recipe, a label and comma-separated dotted overrides -> the variant recipe named <base>-<label>."""
    raw = base.to_dict()
    raw["name"] = f"{base.name}-{label}"
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        raw = _set_dotted(raw, key, yaml.safe_load(value))
    return recipe_mod.Recipe(**raw)


def share_scale_search() -> dict:
    """awq_layer._search_group memoised per (layer, scale group, search settings) -> the cache (for its size)."""
    cache: dict = {}
    search = awq_layer._search_group

    def shared(data, g, quantized, chosen, recipe, spec, dist=None, inputs=None):
        opts = recipe.awq
        key = (data.index, g.prev, tuple(quantized), tuple(chosen), opts.n_grid, opts.duo_scaling,
               recipe.advanced.awq.coarse_step, recipe.advanced.awq.search_dtype, opts.search_tokens, opts.screen_keep,
               spec)
        if key not in cache:
            cache.clear() if cache and next(iter(cache))[0] != data.index else None
            cache[key] = search(data, g, quantized, chosen, recipe, spec, dist, inputs)
        return cache[key]

    awq_layer._search_group = shared
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("variants", nargs="+", help="label:key=value,key=value ...")
    ap.add_argument("--out", default="artifacts")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    base = recipe_mod.load_recipe(a.recipe)
    recipes = [variant(base, *v.split(":", 1)) for v in a.variants]
    share_scale_search()
    for out in runner.run_many(recipes, a.out, force=True):
        print(out)


if __name__ == "__main__":
    main()
