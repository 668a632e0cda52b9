"""RMSNorm fused with the residual add that precedes it, one row per program.

    residual <- x + residual                                     (in place, rounded to the dtype)
    y         = residual / sqrt(mean(residual^2) + eps) * weight

Shapes: x, residual, y [T, H]; weight [H]. Without a residual (the first layer) y = rmsnorm(x)
and x itself is returned as the residual stream.

Rounding follows the model's (Hugging Face's) order so that the torch twin is the model's own
RMSNorm: in fp32 it is one `F.rms_norm`; in bf16 / fp16 the row is normalised in fp32, rounded to
the dtype, and only then multiplied by the weight in the dtype (a second rounding). The kernel
does the same; it differs from the twin only in the order of the fp32 sum of squares (a 1-ulp
difference, rarely visible after rounding to bf16).

Why fused: a decoder layer adds a residual and normalises twice; as separate ops that is a
handful of small launches each (add, pow, mean, rsqrt, mul, cast, mul), and a decode step on a
GPU is bound by launches, not by these bytes.
"""

import torch
import torch.nn.functional as F

from minispec.kernels._checks import check, check_same_device
from minispec.kernels._rounding import round_to
from minispec.kernels._triton import tl, triton

MAX_HIDDEN = 16384  # one row is one tile: wider rows would not fit a program's registers


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], read and overwritten with x + residual (when HAS_RESIDUAL)
    weight_ptr,  # [H]
    y_ptr,  # [T, H]
    stride_xt, stride_rt, stride_yt,  # row strides; the H stride of every tensor is 1
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # [BLOCK]
    inside = offs < hidden
    dtype = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_xt + offs, mask=inside, other=0.0)  # [BLOCK], the tensors' dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rt + offs, mask=inside, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), dtype)  # the sum, rounded as torch's add rounds it
        tl.store(residual_ptr + row * stride_rt + offs, x, mask=inside)
    xf = x.to(tl.float32)  # [BLOCK]
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)  # scalar
    w = tl.load(weight_ptr + offs, mask=inside, other=0.0).to(tl.float32)  # [BLOCK]
    normed = round_to(xf * inv_rms, dtype).to(tl.float32)  # rounded to the dtype before the weight
    tl.store(y_ptr + row * stride_yt + offs, round_to(normed * w, dtype), mask=inside)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual) with residual <- x + residual in place and y = rmsnorm(residual) * weight, a
    new [T, H] tensor; with residual None, (rmsnorm(x) * weight, x)."""
    _check_args(x, residual, weight)
    num_rows, hidden = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, H]
    if num_rows == 0:
        return y, x if residual is None else residual
    block = triton.next_power_of_2(hidden)
    _add_rmsnorm_kernel[(num_rows,)](
        x_ptr=x, residual_ptr=x if residual is None else residual, weight_ptr=weight, y_ptr=y,
        stride_xt=x.stride(0), stride_rt=(x if residual is None else residual).stride(0), stride_yt=y.stride(0),
        hidden=hidden, eps=eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=rmsnorm_warps(block),
    )
    return y, x if residual is None else residual


def rmsnorm_warps(block: int) -> int:
    """Warps for a row of `block` elements: about 8 elements a thread, 1..16 warps."""
    return min(16, max(1, block // 256))


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm: x [..., H] -> [..., H]. fp32: one F.rms_norm. bf16 / fp16: normalise
    in fp32, round to the dtype, then multiply by the weight (Hugging Face's order)."""
    if x.dtype == torch.float32:  # one fused op
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of `add_rmsnorm` (same in-place contract): residual.add_(x) then
    `rmsnorm_ref`, the very ops the model ran as `x = x + sublayer(...)` and `norm(x)`."""
    _check_args(x, residual, weight)
    if residual is None:
        return rmsnorm_ref(x, weight, eps), x
    residual.add_(x)  # (x + residual and residual + x are the same bits)
    return rmsnorm_ref(residual, weight, eps), residual


def _check_args(x, residual, weight) -> None:
    check(x.dim() == 2, lambda: f"x must be [T, H]; got {tuple(x.shape)}")
    hidden = x.shape[1]
    check(weight.shape == (hidden,), lambda: f"weight must be [H={hidden}]; got {tuple(weight.shape)}")
    check(1 <= hidden <= MAX_HIDDEN, lambda: f"hidden size {hidden} is outside 1..{MAX_HIDDEN}")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), lambda: f"unsupported dtype {x.dtype}")
    check(weight.dtype == x.dtype, lambda: f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    check(x.stride(1) == 1 and weight.stride(0) == 1, "x and weight must be contiguous along H")
    check_same_device(x=x, weight=weight)
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype,
              lambda: f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
        check(residual.stride(1) == 1, "residual must be contiguous along H")
        check_same_device(x=x, residual=residual)
