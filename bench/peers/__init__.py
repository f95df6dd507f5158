"""Peer runs (llm-compressor, AutoAWQ) on the calibration token blocks our pipeline builds; each script runs in
its peer's own environment (bench/peers/setup_*.sh)."""
