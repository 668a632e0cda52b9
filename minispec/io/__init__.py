"""Getting weights in and out: HF directories and GGUF files, conversion, EAGLE-3 checkpoints, the
tokenizer, and where the defaults live (paths.py)."""
