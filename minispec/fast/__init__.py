"""Optional speed (skip on a first read): CPU matmul variants chosen by timing, int8 weights with
per-row activation scales, SmoothQuant. Each swaps modules of a loaded model."""
