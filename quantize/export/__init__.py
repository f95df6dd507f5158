"""The export stage: the artifact directory written atomically, with its serve config, model card and serving-cost
figures."""
