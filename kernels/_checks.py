"""Argument checks shared by the kernel launchers.

Every launcher validates before it launches and raises ValueError naming the problem: a bad
launch on a GPU is otherwise an illegal memory access reported far from its cause, or silently
wrong numbers.
"""

from collections.abc import Callable

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def check(condition: bool, message: str | Callable[[], str]) -> None:
    """Raise ValueError(message) unless condition holds. A message that needs formatting is passed
    as a lambda, so that it is built only on failure: the checks run in every layer of every step."""
    if not condition:
        raise ValueError(message() if callable(message) else message)


def check_head_dim(head_dim: int) -> None:
    check(head_dim in SUPPORTED_HEAD_DIMS,
          lambda: f"head_dim {head_dim} is not supported; use a power of two in {SUPPORTED_HEAD_DIMS}")


def check_same_device(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values())).device
    check(all(t.device == first for t in tensors.values()),
          lambda: f"tensors are on different devices: { {name: t.device for name, t in tensors.items()} }")


def no_window() -> int:
    """The sliding window used when there is none: longer than any sequence, still an int32."""
    return 2**31 - 1


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact "ieee" products for fp32 inputs (the GPU default, TF32,
    keeps only 10 mantissa bits); fp16 and bf16 keep the default, which ignores the option."""
    return "ieee" if dtype == torch.float32 else "tf32"
