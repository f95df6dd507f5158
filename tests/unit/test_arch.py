"""The architecture table's own consistency."""

from quantize.arch import ARCHITECTURES, GGUF_ARCHITECTURES, check_gguf_architecture


def test_every_gguf_architecture_converts_to_a_supported_one():
    # a GGUF whose architecture passes the header check must not be refused after its conversion
    assert set(GGUF_ARCHITECTURES.values()) <= set(ARCHITECTURES)
    assert check_gguf_architecture("gemma3", "x") == "Gemma3ForCausalLM"
