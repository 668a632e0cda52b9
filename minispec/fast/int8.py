"""Int8 weights with dynamic per-row activation scales (W8A8), for target and draft alike.

`quantize_model(model)` replaces every `nn.Linear` of a built model (the target, a draft model or an
EAGLE head) with an `Int8Linear`; embeddings and norms stay in the compute dtype. It marks the
model `quantization = "int8"` (model/features.py), which the loaders and other rooms check. Loaded models
are first smoothed (smoothquant.py: activation outliers moved into the weights, calibrated on a
short built-in text); an EAGLE head is not (its fc reads the target's raw residual stream). The quantized
model is a different model from the fp32 one: speculative decoding stays exact with respect to
the model actually run (the verified output is the quantized target's).

The math of one layer, y = x W^T + b with x [M, in], W [out, in]:
  weights, per output channel j (symmetric int8):
      w_scale_j = max_k |W_jk| / 127,    Wq_jk = round(W_jk / w_scale_j) in [-127, 127]
  activations, per row r (dynamic, computed every call from that row alone):
      s_r = max_k |x_rk|,  u_rk = x_rk / s_r in [-1, 1]
      xq_rk = round(u_rk / STEP) in [-64, 64],  STEP = 2/127  (rounded half to even)
  y_rj = s_r * STEP * w_scale_j * sum_k xq_rk * Wq_jk  + b_j
So each row's result depends on that row only: a k+1-row verification scores every token exactly
as a one-row decode would, and batch composition cannot change an output. A per-TENSOR activation
scale (what PyTorch's dynamic quantized linear computes) would break both; see `_fbgemm_linear`
for how that kernel is made to run the per-row scheme.

Activations take 129 levels (about 7 bits, not 8): on x86 CPUs without VNNI the int8 kernels add
pairs of u8 x s8 products in saturating 16-bit lanes, and |xq| <= 64 (stored as xq + 64 <= 128)
keeps that sum exact: 2 * 128 * 127 < 2^15 (PyTorch's `reduce_range`). Accuracy against the fp32 model is measured by `tools/quant_accuracy.py`
(figures in docs/int8.md).

Two implementations of that one definition:
* CPU: PyTorch's quantized linear (`torch.ops.quantized.linear_dynamic`, the fbgemm / x86 engine):
  int8 GEMM, flat in M for the few rows of a decode or verification (docs/int8.md has timings).
  (torchao 0.18's int8 configs and `aten._weight_int8pack_mm` were slower than fp32 on the CPUs measured.)
* Elsewhere (CUDA, or a CPU build without that engine): `int8_linear_reference`, dequantize in the
  matmul; the integer sums are exact in fp32 (and in TF32: both factors have <= 8 significant
  bits) in chunks of 2048 inputs, so it computes the same numbers in any batch.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..model.attention import AttentionBackend
from ..model.llama import Transformer
from .smoothquant import smooth

QUANTIZATIONS = ("int8",)
STEP = 2 / 127  # activation grid step, in units of the row's max |x|
TINY = 1e-30  # an all-zero row quantizes to zeros whatever its scale


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, got {quantization!r}")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (int8 [out, in], fp32 scale [out]), symmetric per
    output channel: weight ~= qweight * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # [out]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zeros
    qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return qweight, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, in] -> (xq: fp32 integers in [-64, 64] [M, in], row scale s [M, 1])."""
    s = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(TINY)  # [M, 1]
    xq = torch.round(x.float() / s / STEP)  # [M, in]
    return xq, s


EXACT_CHUNK = 2048  # |sum of 2048 products| <= 64 * 127 * 2048 < 2^24: exact in fp32 (and TF32)


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The torch twin: x [M, in] -> fp32 [M, out] by the math in the module docstring. The integer
    dot products are summed in chunks of EXACT_CHUNK inputs, each exact in fp32 whatever order a
    GEMM adds in, and the chunk sums are added in a fixed order: so a row's result does not
    depend on the other rows (or the GEMM's choice of kernel). Dequantizes in the matmul: each
    call makes an fp32 copy of the weight (a path that runs, not a fast one)."""
    xq, s = quantize_rows(x)  # [M, in], [M, 1]
    acc = None
    for start in range(0, qweight.shape[1], EXACT_CHUNK):
        cols = slice(start, start + EXACT_CHUNK)
        part = xq[:, cols] @ qweight[:, cols].t().float()  # [M, out]: integer-valued, exact
        acc = part if acc is None else acc.add_(part)
    y = acc * (s * STEP) * scale  # [M, out]
    return y if bias is None else y + bias.float()


def fbgemm_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.quantized.engine in ("x86", "fbgemm")


class Int8Linear(nn.Module):
    """A `Linear` with int8 weights (see the module docstring); forward(x [..., in]) -> [..., out]
    in x's dtype. Buffers: qweight int8 [out, in], scale fp32 [out], bias fp32 [out] or None."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self._packed = None  # the CPU kernel's packed weight, or False: the twin (decided on first use)
        self._bounds: dict[int, torch.Tensor] = {}  # rows -> [rows, 2] constant columns (see _fbgemm_linear)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        qweight, scale = quantize_weight(linear.weight)
        return cls(qweight, scale, None if linear.bias is None else linear.bias.detach().float().clone())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8 W8A8 per-row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [M, in]
        if self._packed is None:
            self._packed = self._pack() if fbgemm_available(self.qweight.device) else False
        if self._packed is not False:
            y = self._fbgemm_linear(x2)
        else:
            y = int8_linear_reference(x2, self.qweight, self.scale, self.bias)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _fbgemm_linear(self, x: torch.Tensor) -> torch.Tensor:
        """PyTorch's dynamic quantized linear picks ONE activation scale for the whole [M, in]
        input, from its min and max. Made per-row: each row is divided by its own max |x| (so it
        lies in [-1, 1]) and two constant columns, +1 and -1, are appended (their weights are
        zero), so every call's min and max are exactly -1 and +1 whatever the other rows hold:
        the kernel's scale is always STEP (its zero point 64). The row's scale is multiplied
        back afterwards. x [M, in] -> fp32 [M, out]."""
        rows = x.shape[0]
        bounds = self._bounds.get(rows)
        if bounds is None:  # [rows, 2] of (+1, -1), kept per row count (a handful: decode, verify, prefill chunks)
            bounds = self._bounds[rows] = torch.tensor([1.0, -1.0]).expand(rows, 2)
        # max |x| per row; abs().amax() rather than vector_norm(x, inf): the same (a max is exact) and
        # 3x cheaper for a few rows on CPU (vector_norm took 9 us at M = 5, the pair 3 us).
        s = x.float().abs().amax(dim=-1, keepdim=True).clamp_min_(TINY)  # [M, 1]
        # A row with NaN / inf has s = NaN / inf: its u is zeroed here (the kernel's min and max stay
        # -1 and +1 for the other rows) and its output becomes NaN again when multiplied by s.
        u = torch.cat((x / s, bounds), dim=-1).nan_to_num_(0.0, 0.0, 0.0)  # [M, in + 2] (fp32: s is)
        y = torch.ops.quantized.linear_dynamic(u, self._packed, True).mul_(s)  # [M, out]; reduce_range: |xq| <= 64
        return y if self.bias is None else y.add_(self.bias)

    def _pack(self):
        """The fbgemm weight: qweight with two zero columns appended, per-channel scales."""
        padded = F.pad(self.qweight, (0, 2)).float()  # [out, in + 2]
        with warnings.catch_warnings():  # quantized-tensor constructors warn that they are deprecated
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(padded * self.scale[:, None], self.scale.double(),
                                            torch.zeros(self.out_features, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None)

    def _apply(self, fn, recurse=True):
        """Moved or cast: pack again from the buffers. Scales and bias stay fp32 (a cast to bf16 and
        back would round them): they only follow qweight's device."""
        self._packed, self._bounds = None, {}
        scale, bias = self.scale, self.bias
        super()._apply(fn, recurse)
        self.scale = scale.to(self.qweight.device)
        self.bias = None if bias is None else bias.to(self.qweight.device)
        return self


def quantize_model(model: nn.Module, quantization: str | None = "int8",
                   calibration: list[list[int]] | None = None) -> nn.Module:
    """Replace every `nn.Linear` in `model` (in place) with its `Int8Linear`; returns model. A tied
    lm_head gets its own int8 copy; the embedding it was tied to stays as it is.
    calibration (token id sequences; a Transformer only): first fold SmoothQuant factors into the
    weights (smoothquant.py), as the loaders do with `smoothquant.CALIBRATION_TEXT`."""
    check_quantization(quantization)
    if quantization is None:
        return model
    if model.quantization is not None:
        raise ValueError(f"this model is already quantized ({model.quantization})")
    if calibration is not None and isinstance(model, Transformer):
        smooth(model, calibration)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child).to(child.weight.device))
    if getattr(model, "backend", None) is not None and getattr(model.backend, "name", None) != "invariant":
        # Quantized activations turn 1-ulp differences between batch shapes into whole int8
        # steps; this backend has none (see model/invariant_attention.py). On CUDA too: the Triton
        # kernels pick tiles and splits by batch shape (correct and slower; unmeasured on a GPU).
        model.backend = AttentionBackend("invariant")
    model.quantization = quantization
    return model
