"""A quantized DRAFT: int4 weight-only linear layers (W4A16), for the draft model only. The model
is marked `quantization = "int4"` (model/features.py).

Why the output stays exact: speculative sampling accepts draft token x with probability
min(1, p(x) / q(x)) and resamples rejections from norm(max(0, p - q)); the proof that the
emitted token has law p holds for ANY draft distribution q (speculative.py). A quantized draft is
just another q: it can only lower acceptance, never change what the target's output is
distributed as. So the draft may be quantized as hard as pays, while the target (whose p IS the
output law) stays as loaded. tests/test_speculative_statistical.py proves it for this draft,
and rejects a draft that samples from one law while reporting another.

Why int4 for the draft: a draft runs one row at a time (k forwards per step) and one row of a
matmul is bound by reading its weights, so a quarter of bf16's bytes makes it several times
cheaper. The same kernel loses to bf16 at the k+1 rows of a verification (it dequantizes per
row), which is why the target is never quantized here. Figures: docs/cpu-performance.md.

The math, per output row j and group g of GROUP consecutive inputs (asymmetric, round to nearest):
    lo = min_k W_jk, hi = max_k W_jk over the group,  s = (hi - lo) / 15,  z = lo + 8 s
    q_jk = round((W_jk - lo) / s) in [0, 15],        W_jk ~= (q_jk - 8) * s + z
That is the layout of torch's CPU kernel (`aten._weight_int4pack_mm_for_cpu`: values packed by
`aten._convert_weight_to_int4pack_for_cpu`, scales and zeros [in / GROUP, out, 2]). A layer whose
shape that kernel cannot take (out not a multiple of 16, in not of GROUP) gets int8 weight-only
(`aten._weight_int8pack_mm`, symmetric per output row) if in is a multiple of 16, else stays as
it was. Off the CPU there is no such kernel: `int4_linear_reference` (dequantize, then F.linear)
is the torch twin the tests compare against, not a path to run a draft on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_linear import PrepackedLinear

GROUP = 32  # inputs per scale/zero pair
KERNEL_DTYPE = torch.bfloat16  # Int4Linear's compute dtype, whatever the model's (see Int4Linear)
INNER_K_TILES = 2  # the CPU kernel's packing parameter
DRAFT_QUANTIZATIONS = ("int4",)


def cpu_int4_available() -> bool:
    """Whether this torch build has the CPU int4 weight-only kernels."""
    return all(hasattr(torch.ops.aten, op) for op in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"))


INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default if cpu_int4_available() else None  # (bound once: cheaper to call)


def check_draft_quantization(quantization: str | None, device: torch.device | None = None) -> None:
    """A ValueError naming the problem unless `quantization` can run the draft here."""
    if quantization is None:
        return
    if quantization not in DRAFT_QUANTIZATIONS:
        raise ValueError(f"draft quantization must be None or one of {', '.join(map(repr, DRAFT_QUANTIZATIONS))}, "
                         f"got {quantization!r}")
    if device is not None and device.type != "cpu":
        raise ValueError(f"draft quantization {quantization!r} runs on CPU (torch's CPU int4 kernel); on {device.type} "
                         "leave the draft unquantized")
    if not cpu_int4_available():
        raise ValueError(f"draft quantization {quantization!r}: this torch build ({torch.__version__}) has no CPU int4 "
                         "weight-only kernel (aten._weight_int4pack_mm_for_cpu); use torch >= 2.6 or leave the draft unquantized")


def quantize_int4(weight: torch.Tensor, rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int32 [out, in] in 0..15, scales_and_zeros fp32 [in / GROUP, out, 2])."""
    qs, pairs = zip(*quantized_blocks(weight, rows))
    return torch.cat(qs), torch.cat(pairs, dim=1).contiguous()


def quantized_blocks(weight: torch.Tensor, rows: int = 2048):
    """(q int32 [r, in], scales_and_zeros fp32 [in / GROUP, r, 2]) for each block of `rows` output
    rows in turn: a block's fp32 and int32 copies, never the whole weight's (the LM head's int32 q
    alone would be 4 bytes a weight)."""
    out_features, in_features = weight.shape
    for start in range(0, out_features, rows):
        block = weight[start : start + rows].detach().to(torch.float32, copy=True)  # (a copy: worked on in place)
        groups = block.view(-1, in_features // GROUP, GROUP)  # [r, G, GROUP]
        lo, hi = torch.aminmax(groups, dim=-1)  # [r, G]
        scale = ((hi - lo) / 15).clamp_min_(1e-12)  # a constant group: any scale, q = 0
        q = groups.sub_(lo[..., None]).mul_((1 / scale)[..., None]).round_().clamp_(0, 15)  # (W - lo) / s, rounded
        yield q.to(torch.int32).view(-1, in_features), torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1)  # [G, r, 2]


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The inverse map: q [out, in], scales_and_zeros [in / GROUP, out, 2] -> W [out, in] (fp32)."""
    out_features, in_features = q.shape
    scale = scales_and_zeros[..., 0].t().float().repeat_interleave(GROUP, dim=1)  # [out, in]
    zero = scales_and_zeros[..., 1].t().float().repeat_interleave(GROUP, dim=1)
    return (q.float() - 8) * scale + zero


def int4_linear_reference(x: torch.Tensor, q: torch.Tensor, scales_and_zeros: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The torch twin of Int4Linear: x [M, in] @ dequantize(q)^T (+ bias), in x's dtype; x, s, z and
    the bias rounded to KERNEL_DTYPE first, as Int4Linear rounds them."""
    k = KERNEL_DTYPE
    weight = dequantize_int4(q, scales_and_zeros.to(k)).to(k)
    y = F.linear(x.to(k), weight, None if bias is None else bias.to(k))
    return y.to(x.dtype)


class Int4Linear(nn.Module):
    """y = x W^T + b with W held as int4 in torch's CPU kernel layout (module docstring).
    Buffers: packed (the kernel's uint8 tiles), scales_and_zeros [in / GROUP, out, 2] and the bias
    (or None) in KERNEL_DTYPE. forward(x [..., in]) -> [..., out] in x's dtype.

    The matmul runs in bf16 whatever x's dtype: torch's CPU int4 kernel is vectorized for bf16
    only, and with fp32 or fp16 activations it is over ten times slower than with bf16 at one row
    (docs/cpu-performance.md), slower even than the dense fp32 matmul it replaces. An fp32 draft
    so computes each int4 matmul on x rounded to bf16: another q, which costs no exactness (module
    docstring)."""

    def __init__(self, in_features: int, out_features: int, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.out_features % 16 == 0 and linear.in_features % GROUP == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "Int4Linear":
        """dtype (the model's) is not used: scales, zeros and bias are held in KERNEL_DTYPE; the
        argument keeps the signature of Int8WeightOnlyLinear.from_linear (quantize_int4_model)."""
        packed, pairs = [], []
        for q, block_pairs in quantized_blocks(dense(linear)):  # the kernel's layout is row-separable: packed by block
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES))
            pairs.append(block_pairs)
        packed, scales_and_zeros = torch.cat(packed), torch.cat(pairs, dim=1)
        bias = None if linear.bias is None else linear.bias.detach().to(KERNEL_DTYPE).clone()
        return cls(linear.in_features, linear.out_features, packed, scales_and_zeros.to(KERNEL_DTYPE), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weight-only, group {GROUP}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == KERNEL_DTYPE and x.is_contiguous():  # a draft's rows: no reshape or cast (ops are its cost)
            y = INT4_MM(x, self.packed, GROUP, self.scales_and_zeros)  # [M, out]
            return y if self.bias is None else y.add_(self.bias)
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()  # [M, in]
        y = INT4_MM(x2, self.packed, GROUP, self.scales_and_zeros)  # [M, out]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int8WeightOnlyLinear(nn.Module):
    """The fallback for a shape the int4 kernel cannot take: W as int8 per output row,
    W_jk ~= qw_jk * scale_j (symmetric), through `aten._weight_int8pack_mm`."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.in_features % 16 == 0  # (other widths crash the kernel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "Int8WeightOnlyLinear":
        w = dense(linear).float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
        qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()
        return cls(qweight, scale.to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def dense(linear: nn.Linear) -> torch.Tensor:
    """A linear layer's W [out, in], whichever CPU variant holds it (fast/cpu_linear.py)."""
    return linear.dense_weight() if isinstance(linear, PrepackedLinear) else linear.weight.detach()


def quantize_int4_model(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of a (draft) model, in place, its LM head included, by its int4
    layer, the int8 weight-only fallback, or nothing where neither fits; returns the model. Each
    full-precision weight is freed as soon as its layer is replaced (one layer's worth at a time).
    The embedding stays as it is (a tied LM head gets its own int4 copy)."""
    check_draft_quantization("int4", model.device)
    if model.quantization is not None:
        raise ValueError(f"this model is already quantized ({model.quantization})")
    dtype = model.dtype
    slots = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    for parent, name in slots:
        linear = getattr(parent, name)
        kind = Int4Linear if Int4Linear.fits(linear) else Int8WeightOnlyLinear if Int8WeightOnlyLinear.fits(linear) else None
        if kind is not None:
            setattr(parent, name, kind.from_linear(linear, dtype))
        del linear
    model.quantization = "int4"
    return model
