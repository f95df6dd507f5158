"""On-disk tensor layouts that vLLM reads. One module per format; each has pack and unpack."""
