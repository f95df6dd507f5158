"""quantize: recipe-driven AWQ/GPTQ 4-bit weight quantization that writes directories vLLM loads."""

__version__ = "0.1.0"
