"""AWQ variants that differ only after the scale search (clip, scale refit, rounding), quantized in one pass.

    python bench/awq_variants.py smollm2-awq-g64 --out /tmp/art \
        base: rps: awq.clip_search=per_side,awq.refit_iters=2 gptq: awq.rounding=gptq ...

Each variant is `name:` followed by comma-separated dotted recipe keys overriding the base recipe; the
artifacts are written as `<out>/<base>-<name>`. The pass is `runner.run_many`'s (one load, one calibration,
every variant on its own copy of each layer); variants whose scale-search settings are the same (all but the
clip, refit and rounding keys, or awq.search_group_size) run one search per layer and scale group between them
(`awq_layer.search_layer_scales`: exact, the search's inputs are identical). Records each variant's quantize
seconds in its manifest as usual.
"""

from __future__ import annotations

import argparse
import logging

import yaml

from quantize import recipe as recipe_mod, runner
from quantize.recipe.load import _set_dotted


def variant(base: recipe_mod.Recipe, label: str, overrides: str) -> recipe_mod.Recipe:
    """base recipe, a label and comma-separated dotted overrides -> the variant recipe named <base>-<label>."""
    raw = base.to_dict()
    raw["name"] = f"{base.name}-{label}"
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        raw = _set_dotted(raw, key, yaml.safe_load(value))
    return recipe_mod.Recipe(**raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("variants", nargs="+", help="label:key=value,key=value ...")
    ap.add_argument("--out", default="artifacts")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    base = recipe_mod.load_recipe(a.recipe)
    recipes = [variant(base, *v.split(":", 1)) for v in a.variants]
    for out in runner.run_many(recipes, a.out, force=True):
        print(out)


if __name__ == "__main__":
    main()
