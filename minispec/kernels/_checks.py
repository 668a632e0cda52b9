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


def check_dense(**tensors: torch.Tensor) -> None:
    """1-D index tensors must be dense (stride 1): the kernels read element i at base + i, so a
    strided view (x[::2]) would be read past its values, out of bounds on a GPU."""
    for name, t in tensors.items():
        check(t.dim() != 1 or t.numel() < 2 or t.stride(0) == 1,
              lambda: f"{name} must be contiguous (stride 1), got stride {t.stride(0)}; pass {name}.contiguous()")


def should_validate(validate: bool | None, t: torch.Tensor) -> bool:
    """Whether a launcher checks the VALUES of its index tensors (a device sync on a GPU). None:
    yes, on every device, except while a CUDA graph is being captured (a sync there is an
    error). Bad values on a GPU are otherwise an illegal access or a device-side assert that
    poisons the process's CUDA context (seen on an H200). The engine, which builds these tensors
    itself, passes False on its hot path."""
    if validate is not None:
        return validate
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def no_window() -> int:
    """The sliding window used when there is none: longer than any sequence, still an int32."""
    return 2**31 - 1


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact "ieee" products for fp32 inputs (the GPU default, TF32,
    keeps only 10 mantissa bits); fp16 and bf16 keep the default, which ignores the option."""
    return "ieee" if dtype == torch.float32 else "tf32"
