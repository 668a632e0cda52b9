"""Triton kernels of minispec, each with a plain-torch reference twin of the same signature.

    flash_prefill / flash_prefill_ref       causal attention over a packed variable-length batch
    paged_attention / paged_attention_ref   new tokens over a paged KV cache (decode, verify, chunk)
    write_kv / write_kv_ref                 scatter new K/V into the paged cache

The references are exact fp32 computations and double as minispec's CPU attention backend.
"""

import os

import torch

# Triton compiles for GPUs only; on a machine without CUDA its interpreter runs the same kernels
# on CPU (slowly), which is how the tests check them there. The interpreter is chosen when a
# kernel is decorated, so the variable must be set before the kernel modules are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.flash_prefill import flash_prefill, flash_prefill_ref  # noqa: E402
from kernels.kv_write import write_kv, write_kv_ref  # noqa: E402
from kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402

__all__ = [
    "flash_prefill",
    "flash_prefill_ref",
    "paged_attention",
    "paged_attention_ref",
    "write_kv",
    "write_kv_ref",
]
