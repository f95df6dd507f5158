"""Evaluation of artifacts: perplexity under one recorded protocol, vLLM smoke loads, reports."""
