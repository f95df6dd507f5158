"""The capture stage: the layer-by-layer pass over calibration activations, the per-recipe jobs it feeds, the device it
runs on, its checkpoints and its ranks."""
