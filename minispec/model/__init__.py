"""The model: the Llama-family decoder (llama.py), the EAGLE-3 head's layers (eagle.py), and the
attention interface (metadata.py, attention.py) through which the paged KV cache and kernels plug in."""
