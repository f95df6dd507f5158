"""Pre-flight: what is checked before any weight loads (the plan, the formats' and vLLM's kernels, the deployability
table)."""
