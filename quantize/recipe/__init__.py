"""Recipe schema: one YAML file per artifact, validated before any model loads.

A recipe names the model, the method and its settings, the calibration text and the output format.
`base: <recipe>` inherits another recipe and overrides keys (nested mappings merge key by key), so a
group-size family is a few small files. Unknown keys, bad values and combinations vLLM cannot serve are
refused with a message that names the key, the value and what is allowed.

Settings that say what the artifact is or how good it is (method, bits, group size, symmetry, calibration, the
AWQ and GPTQ settings of the papers and of AutoAWQ, incl. awq.search_tokens, whose default already subsamples)
are top-level keys and sections. Speed experiments are under `advanced:`: their defaults are the plain
algorithm (but for search_dtype: auto on a float32 CPU run with AMX, below), and changing one trades quality
for time or changes only time and memory, as docs/BENCHMARKS.md measured for each:
  advanced.awq.coarse_step   coarse-to-fine over the ratio grid (k = 4 missed the grid minimum: +0.07 ppl)
  advanced.awq.grid_batch    candidates per matmul in single-linear groups (memory; exact)
  advanced.awq.clip_kernel   the clip search's implementation: auto (Triton on CUDA) | torch | triton
  advanced.awq.search_kernel the scale search's candidate fake-quantization: auto (Triton on CUDA) | torch |
                             triton (the same values bit for bit)
  advanced.awq.search_dtype  the scale search's block forwards: auto (bfloat16 on a float32 CPU run with AMX)
                             | compute | bfloat16 (an approximation of the loss: its quality is measured)
  advanced.gptq.kernel       the column sweep's implementation: auto (Triton on CUDA) | torch | triton (same codes)
  advanced.gptq.update       the sweep's cross-block update in float32 or in TF32 operands (an approximation)
"""

# the package's names, so `from quantize.recipe import Recipe` reads the same from any module
from .load import RECIPES_DIR, expand_sweep, list_recipes, load_recipe, load_variants, model_beside, recipe_path
from .options import (AUTO, Advanced, AdvancedAwq, AdvancedGptq, AutoOptions, Calibration, EvalOptions, GROUP_SIZES,
                      KV_CACHE_DTYPES, LmEvalOptions, MAX_KL, MIN_EXPERT_TOKENS, MIN_TOP1, MixedOptions, MoeOptions,
                      PerplexityOptions, RecipeError, SERVED_NAME, SERVE_CAPABILITIES, ServeOptions, ServeTarget,
                      VllmSmokeOptions)
from .schema import Recipe, parse_size
