"""Batch-invariant attention (torch): every query row's output is bitwise the same whatever else
is in the forward: a one-token decode, row i of a k+1-token verification, a prompt's prefill, one
sequence or many.

Why it exists. The reference backend attends with batched matmuls and a softmax over the batch's
longest context, and CPU GEMM kernels round a row differently for different matrix shapes (a
row's scores from a [3, 15] product differ in the last bit from the same row in a [15, 19]
product). In fp32 that is ~1e-7 and greedy decoding does not notice. A model whose activations
are quantized (quant.py) does: a 1-ulp change can move a value across a rounding boundary of its
int8 grid, which changes it by a whole step, and through 30 layers the logits move by up to ~1
(measured on SmolLM2-135M: greedy speculative decoding parted from plain decoding at gaps of
0.18-0.82). So an int8 target gets this backend (quant.quantize_model switches to it, on any
device: the Triton kernels choose tiles and splits by batch shape; on CUDA this path is correct,
not fast, and has not been run on a GPU).

How. Row r (query position p, context c = p + 1 keys) is computed with reductions whose length
depends on c only: its keys are padded to L = c rounded up to a multiple of BUCKET (masked); its
scores are sum over D of q * k, its softmax runs over L, its output is sum over L of probs * v,
each an elementwise product and a sum over the last, contiguous axis, which torch reduces in one
fixed order per output element (and splits over threads by output, never inside one). Not
matmuls: CPU GEMMs round a row differently depending on the other rows, on the matrix sizes and
even on the operands' memory alignment (measured: the same [3, 64] x [64, 32] product, batch 1
vs 2, differed). Rows with the same L are computed together. Cost: a gather and a few ops per
distinct L per layer (a decode or a verification: 1-2; a prefill of T tokens: T / BUCKET), and
products of R x Hq x L x D floats, chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import BatchMetadata

BUCKET = 32  # keys per row are padded to a multiple of this


@dataclass
class Bucket:
    """The rows of one forward whose keys are padded to the same length L."""

    rows: torch.Tensor | None  # [R] row ids (None: all rows of the forward, in order)
    slots: torch.Tensor  # [R, L] int64 slot of each key (masked keys: any valid slot)
    visible: torch.Tensor  # [R, L] bool


@dataclass
class InvariantPlan:
    """Everything but q and the pools, built once per forward and shared by its layers."""

    buckets: list[Bucket]
    sliding_window: int | None


def invariant_plan(meta: BatchMetadata, page_size: int | None, sliding_window: int | None) -> InvariantPlan:
    """Group the forward's rows by padded key count L = ceil((position + 1) / BUCKET) * BUCKET and
    find their keys: page_size None (a prefill over the forward's own K/V): slot = the sequence's
    first new row + j; else the page pool's slot through the block table."""
    starts = meta.query_start_loc.long()  # [B+1]
    counts = starts[1:] - starts[:-1]  # [B]
    seq_of_row = torch.repeat_interleave(torch.arange(len(counts), device=starts.device), counts)  # [T]
    positions = meta.positions.tolist()
    lengths = [-(-(p + 1) // BUCKET) * BUCKET for p in positions]  # padded key count per row
    distinct = sorted(set(lengths))
    buckets = []
    for L in distinct:
        rows = None if len(distinct) == 1 else torch.tensor([t for t, n in enumerate(lengths) if n == L], device=starts.device)
        seqs = seq_of_row if rows is None else seq_of_row[rows]  # [R]
        row_pos = (meta.positions if rows is None else meta.positions[rows])[:, None]  # [R, 1]
        j = torch.arange(L, device=starts.device)  # [L]
        visible = j <= row_pos  # [R, L]
        if sliding_window is not None:
            visible &= j > row_pos - sliding_window
        if page_size is None:
            slots = starts[seqs][:, None] + j  # [R, L]
        else:
            pages = meta.block_tables.long()[seqs]  # [R, max_pages]
            slots = pages[:, (j // page_size).clamp(max=pages.shape[1] - 1)] * page_size + j % page_size  # [R, L]
        buckets.append(Bucket(rows, torch.where(visible, slots, slots[:, :1]), visible))
    return InvariantPlan(buckets, sliding_window)


def invariant_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: InvariantPlan,
                        sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D]; k_pool / v_pool [S, Hkv, D] (keys by slot, as `plan` addresses them).
    Returns [T, Hq, D] in q's dtype: softmax(sm_scale q k^T + mask) v per row, fp32 inside."""
    T, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if len(plan.buckets) > 1 else None  # [T, Hq, D]
    for b in plan.buckets:
        R, L = b.slots.shape
        keys = k_pool[b.slots].float().transpose(1, 2)  # [R, Hkv, L, D]
        values_t = v_pool[b.slots].float().permute(0, 2, 3, 1).contiguous()  # [R, Hkv, D, L]: L innermost
        q_b = (q if b.rows is None else q[b.rows]).float().view(R, num_kv_heads, group, head_dim)  # [R, Hkv, g, D]
        step = chunk_rows(L, num_q_heads, head_dim)
        parts = []
        for c in range(0, R, step):  # bounds the products' memory
            rc = slice(c, c + step)
            # Dot products as multiply + sum over the last axis (D, then L): a fixed reduction per
            # output element, unlike a GEMM, whose rounding depends on the shapes and alignment.
            scores = (q_b[rc, :, :, None, :] * keys[rc, :, None]).sum(-1).mul_(sm_scale)  # [r, Hkv, g, L]
            scores.masked_fill_(~b.visible[rc, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # [r, Hkv, g, L]
            parts.append((probs[:, :, :, None, :] * values_t[rc, :, None]).sum(-1))  # [r, Hkv, g, D]
        o = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(R, num_q_heads, head_dim).to(q.dtype)  # [R, Hq, D]
        if out is None:
            return o
        out[b.rows] = o
    return out


def chunk_rows(L: int, num_q_heads: int, head_dim: int, budget: int = 1 << 22) -> int:
    """Rows per chunk so that one [rows, Hq, L, D] product holds at most `budget` floats."""
    return max(1, budget // (L * num_q_heads * head_dim))
