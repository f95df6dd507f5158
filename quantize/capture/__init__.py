"""The capture stage: the layer-by-layer pass over calibration activations, the device it runs on, its checkpoints
and its ranks. It feeds any `loop.LayerJob`; the methods' jobs live in `methods.job`."""
