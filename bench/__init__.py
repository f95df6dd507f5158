"""Benchmarks of the quantize pipeline against its peers (llm-compressor, AutoAWQ): speed on a GPU, quality on
real models. Not part of the product: it reads the product's run record (`quantize.runlog.RunLog`) and
artifacts, the product never imports it. bench/README.md lists each benchmark, its command and its results."""
