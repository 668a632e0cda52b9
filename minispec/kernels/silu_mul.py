"""SwiGLU's gate: silu(gate) * up from the fused gate/up projection's output, in one launch.

    out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i],   silu(g) = g / (1 + exp(-g))

Shapes: gate_up [T, 2I] (gate in the first half of each row, up in the second; any row stride),
out [T, I] contiguous. Rounding as the model's torch ops: silu computed in fp32 and rounded to
the dtype, then the product rounded (`F.silu(gate) * up` in bf16 / fp16). The kernel's exp is not
torch's, so the two agree to an ulp, not always bit for bit.

Grid: (T, ceil(I / BLOCK)), BLOCK a fixed 1024 elements (no autotuning: an elementwise kernel's
speed hardly depends on it once a program moves a few KiB).
"""

import torch
import torch.nn.functional as F

from minispec.kernels._checks import check, check_same_device
from minispec.kernels._rounding import round_to
from minispec.kernels._triton import tl, triton

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_gt, stride_ot,  # row strides; the column stride of both is 1
    intermediate,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    inside = offs < intermediate
    gate = tl.load(gate_up_ptr + row * stride_gt + offs, mask=inside, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(gate_up_ptr + row * stride_gt + intermediate + offs, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)  # rounded as F.silu's output is
    tl.store(out_ptr + row * stride_ot + offs, round_to(silu * up, dtype), mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I] (module docstring)."""
    _check_args(gate_up)
    num_rows, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty(num_rows, intermediate, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    if num_rows == 0:
        return out
    _silu_mul_kernel[(num_rows, triton.cdiv(intermediate, BLOCK))](
        gate_up_ptr=gate_up, out_ptr=out, stride_gt=gate_up.stride(0), stride_ot=out.stride(0),
        intermediate=intermediate, BLOCK=BLOCK, num_warps=4,
    )
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of `silu_mul`, the model's own ops: gate_up [..., 2I] -> [..., I]. Any
    number of leading dimensions (training runs it on [B, T, 2I])."""
    check(gate_up.shape[-1] % 2 == 0, lambda: f"gate_up's last dimension must be even (2I); got {gate_up.shape[-1]}")
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


def _check_args(gate_up: torch.Tensor) -> None:
    check(gate_up.dim() == 2, lambda: f"gate_up must be [T, 2I]; got {tuple(gate_up.shape)}")
    check(gate_up.shape[1] % 2 == 0 and gate_up.shape[1] > 0,
          lambda: f"gate_up's last dimension must be even and positive (2I); got {gate_up.shape[1]}")
    check(gate_up.dtype in (torch.float16, torch.bfloat16, torch.float32), lambda: f"unsupported dtype {gate_up.dtype}")
    check(gate_up.stride(1) == 1, "gate_up must be contiguous along its last dimension")
    check_same_device(gate_up=gate_up)
