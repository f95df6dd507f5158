"""The pipeline: recipe -> quantize -> eval -> compare -> register, and the command line over it.

The layers import one way: `pipeline` uses `eval` and `quantize`; `eval` uses `quantize`'s recipe, manifest,
formats and model loading; `quantize` imports neither.
"""
