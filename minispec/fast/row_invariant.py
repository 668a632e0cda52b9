"""Row invariance on CPU: each row of the target's forward gets the same bits whether it is computed
alone (a decode step), among the k+1 rows of a verification, in a tree, or beside other sequences
(what vLLM calls batch invariance, VLLM_BATCH_INVARIANT=1; SGLang --enable-deterministic-inference).

Why it matters. Greedy speculative decoding emits the target's argmax at every position, as plain
decoding does, but computes it in a verification row instead of a decode row. If those two rows
round differently, a near-tie between the top two logits can go the other way (in bf16 it does,
tens of times in a few thousand tokens), and a reader cannot tell that from a bug. With every row
computed the same way, greedy speculative output is plain greedy output bit for bit, and a seeded
sampled request draws from the same p in both.

What torch's CPU kernels do (measured, docs/cpu-performance.md), and what is done about it:
* F.linear rounds row i differently for different row counts M (bf16 and fp32). oneDNN's linear
  on a prepacked weight (`mkldnn._linear_pointwise`, fast/cpu_linear.py) gives every row the same
  bits for every M >= 2 tested (2..600, bf16 and fp32, with and without bias, any position of the
  row), but a 1-row input takes another path on some shapes (e.g. 2048 x 1536). So every linear
  layer runs prepacked, and a 1-row input is padded with a row of zeros (RowInvariantLinear).
* oneDNN packs a bf16 weight only on CPUs with AVX512 (or AVX-NE-CONVERT; fast/cpu_caps.py). On
  the others (AVX2 only) a bf16 target's layers keep an fp32 packed copy and compute in fp32:
  the input row is widened and the output row rounded to bf16 one row at a time, so the result
  is still the same bits for every row count (and closer to exact than bf16 compute).
* The reference attention backend computes a decode row and a verification row with matmuls of
  different shapes: the target runs the invariant backend (model/invariant_attention.py), whose
  reductions depend on a row's own context length only.
* RMSNorm, RoPE, SwiGLU and the embedding are row-wise: nothing to do. Sampling is per row.

The cost (a padded row per decode step and the invariant attention) is measured by bench.py and
stated in docs/cpu-performance.md; it is an option because it exceeds 3% of a decode step on the
CPUs measured. A draft model or EAGLE head needs none of this: any q is exact. The model is marked
`row_invariant = True`, `cpu_matmul = "row_invariant"` (model/features.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.attention import AttentionBackend
from .cpu_caps import cpu_caps
from .cpu_linear import PrepackedLinear, as_variant, linear_slots

ROW_INVARIANT_DTYPES = (torch.float32, torch.bfloat16)


class RowInvariantLinear(PrepackedLinear):
    """PrepackedLinear whose 1-row inputs are computed as 2 rows (the second zeros), so that every
    row count takes oneDNN's one GEMM path (module docstring). x [..., in] -> [..., out]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:
            return super().forward(torch.cat([x, torch.zeros_like(x)]))[:1]
        return super().forward(x)


def check_row_invariant(device: torch.device, dtype: torch.dtype) -> None:
    """A ValueError naming what row invariance cannot cover here."""
    if device.type != "cpu":
        raise ValueError(f"row_invariant=True is for CPU (on {device.type}, the kernels choose tiles by batch shape)")
    if dtype not in ROW_INVARIANT_DTYPES:
        raise ValueError(f"row_invariant=True covers float32 and bfloat16 (oneDNN's linear), not {dtype}")


def invariant_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a row-invariant layer of a `dtype` model computes in on this CPU: its own, or fp32
    for bf16 where oneDNN cannot pack bf16 weights (module docstring)."""
    return torch.float32 if dtype == torch.bfloat16 and not cpu_caps().onednn_bf16_prepack else dtype


def make_row_invariant(model: nn.Module, on: bool = True) -> nn.Module:
    """Make a (target) Transformer row-invariant in place and return it: every nn.Linear becomes a
    RowInvariantLinear (keeping only oneDNN's copy of a weight nobody else holds), attention runs
    the invariant backend. on=False switches a model made so back to the prepacked layers and its
    former backend (nothing is reloaded: the bench times both on one model). An int8 model is
    left as it is: its layers and attention already are invariant (fast/int8.py)."""
    if model.quantization == "int8" or getattr(model, "row_invariant", False) == on:
        return model
    if not on:
        for _, _, child in linear_slots(model):
            child.__class__ = PrepackedLinear
        model.backend, model.row_invariant = model._backend_before, False
        model.cpu_matmul = "prepacked"
        return model
    check_row_invariant(model.device, model.dtype)
    compute = invariant_compute_dtype(model.dtype)
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    for parent, attr, child in linear_slots(model):
        if isinstance(child, PrepackedLinear) and (child.compute_dtype or child.weight.dtype) == compute:
            child.__class__ = RowInvariantLinear  # keeps its packed copy (and a packed-only layer stays so)
            continue
        if isinstance(child, PrepackedLinear):
            child.restore_dense()  # (packed in another dtype: W back before it is packed again)
        module = as_variant(child, RowInvariantLinear)
        if compute != module.weight.dtype:
            module.compute_dtype = compute
        if id(module.weight) not in shared:
            module.keep_packed_only()
        setattr(parent, attr, module)
    model._backend_before, model.backend = model.backend, AttentionBackend("invariant")
    model.cpu_matmul, model.row_invariant = "row_invariant", True
    return model
