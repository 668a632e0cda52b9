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
0.18-0.82). So an int8 target gets this backend (quant.quantize_model switches to it on CPU).

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

import torch

from .attention import BatchMetadata

BUCKET = 32  # keys per row are padded to a multiple of this


def invariant_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    key_slots: torch.Tensor,
    positions: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [T, Hq, D]; k_pool / v_pool [S, Hkv, D] (keys by slot); key_slots [T, Lmax] int64: slot of
    key j of row t's sequence (j <= positions[t] are read); positions [T] (host-visible ints).
    Returns [T, Hq, D] in q's dtype: softmax(sm_scale q k^T + mask) v per row, fp32 inside."""
    T, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)  # [T, Hq, D]
    pos = positions.tolist()
    lengths = [-(-(p + 1) // BUCKET) * BUCKET for p in pos]  # padded key count per row
    for L in sorted(set(lengths)):
        rows = [t for t in range(T) if lengths[t] == L]
        rows_t = torch.tensor(rows, device=q.device)  # [R]
        R = len(rows)
        key_pos = torch.arange(L, device=q.device)  # [L]
        row_pos = positions[rows_t][:, None]  # [R, 1]
        visible = key_pos <= row_pos  # [R, L]
        if sliding_window is not None:
            visible &= key_pos > row_pos - sliding_window
        slots = torch.where(visible, key_slots[rows_t, :L], key_slots[rows_t, :1])  # [R, L] (masked: any valid slot)
        keys = k_pool[slots].float().transpose(1, 2)  # [R, Hkv, L, D]
        values_t = v_pool[slots].float().permute(0, 2, 3, 1)  # [R, Hkv, D, L]
        q_r = q[rows_t].float().view(R, num_kv_heads, group, head_dim)  # [R, Hkv, g, D]
        for c in range(0, R, chunk_rows(L, num_q_heads, head_dim)):  # bounds the products' memory
            rc = slice(c, min(c + chunk_rows(L, num_q_heads, head_dim), R))
            # Dot products as multiply + sum over the last axis (D, then L): a fixed reduction per
            # output element, unlike a GEMM, whose rounding depends on the shapes and alignment.
            scores = (q_r[rc, :, :, None, :] * keys[rc, :, None]).sum(-1).mul_(sm_scale)  # [r, Hkv, g, L]
            scores.masked_fill_(~visible[rc, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # [r, Hkv, g, L]
            o = (probs[:, :, :, None, :] * values_t[rc, :, None]).sum(-1)  # [r, Hkv, g, D]
            out[rows_t[rc]] = o.reshape(-1, num_q_heads, head_dim).to(q.dtype)  # [r, Hq, D]
    return out


def chunk_rows(L: int, num_q_heads: int, head_dim: int, budget: int = 1 << 22) -> int:
    """Rows per chunk so that one [rows, Hq, L, D] product holds at most `budget` floats."""
    return max(1, budget // (L * num_q_heads * head_dim))


def key_slots(meta: BatchMetadata, page_size: int | None) -> torch.Tensor:
    """[T, Lmax] int64: slot of key j for each new token's sequence. page_size None (a prefill
    over the forward's own K/V): slot = the sequence's first new row + j; else the paged pool's
    slot through the block table."""
    starts = meta.query_start_loc.long()  # [B+1]
    seq_of_row = torch.repeat_interleave(torch.arange(len(starts) - 1, device=starts.device), starts[1:] - starts[:-1])  # [T]
    j = torch.arange(-(-meta.max_seq_len // BUCKET) * BUCKET, device=starts.device)  # [Lmax]
    if page_size is None:
        return starts[seq_of_row][:, None] + j.clamp(max=meta.max_seq_len - 1)  # [T, Lmax] (past the end: masked)
    pages = meta.block_tables.long()[seq_of_row]  # [T, max_pages]
    page_of_key = (j // page_size).clamp(max=pages.shape[1] - 1)  # [Lmax]
    return pages[:, page_of_key] * page_size + j % page_size  # [T, Lmax]
