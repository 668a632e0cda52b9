"""Rounding fp32 values to a kernel's storage dtype, to nearest even, in every way a kernel runs.

The fused elementwise kernels round each intermediate to the tensors' dtype exactly where the
model's torch ops round (a bf16 add, a bf16 product), so that they agree with their torch twins
bit for bit. `x.to(tl.bfloat16)` rounds to nearest even on a GPU, but Triton's CPU interpreter
truncates, which would make every interpreter test of the bf16 path see 1-ulp differences. So
bf16 is rounded here with integer arithmetic (add half an ulp, plus one if the kept last bit is
odd, then drop the low 16 bits), after which the cast is exact everywhere; NaN stays NaN. fp16
and fp32 use the plain cast, which is right in both.
"""

from minispec.kernels._triton import tl, triton


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to nearest even in DTYPE (returned in DTYPE)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        rounded = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # (a NaN's low bits could carry to inf)
        return rounded.to(tl.bfloat16)
    else:
        return x.to(DTYPE)
