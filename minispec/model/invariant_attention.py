"""Batch-invariant attention (torch): every query row's output is bitwise the same whatever else
is in the forward: a one-token decode, row i of a k+1-token verification, a prompt's prefill, one
sequence or many.

Why it exists. The reference backend attends with batched matmuls and a softmax over the batch's
longest context, and CPU GEMM kernels round a row differently for different matrix shapes (a
row's scores from a [3, 15] product differ in the last bit from the same row in a [15, 19]
product). In fp32 that is ~1e-7 and greedy decoding does not notice. A model whose activations
are quantized (fast/int8.py) does: a 1-ulp change can move a value across a rounding boundary of its
int8 grid, which changes it by a whole step, and through 30 layers the logits move by up to ~1
(enough for greedy speculative decoding to part from plain decoding where the top two logits are
close). So an int8 target gets this backend (fast.int8.quantize_model switches to it, on any
device: the Triton kernels choose tiles and splits by batch shape; on CUDA this path is correct,
not fast, and has not been run on a GPU).

How. Row r (query position p, context c = p + 1 keys) is computed with reductions whose length
depends on c only: its keys are padded to L = c rounded up to a multiple of BUCKET (masked); its
scores are sum over D of q * k, its softmax runs over L, its output is sum over L of probs * v,
each an elementwise product and a sum over the last, contiguous axis, which torch reduces in one
fixed order per output element (and splits over threads by output, never inside one). Not
matmuls: CPU GEMMs round a row differently depending on the other rows, on the matrix sizes and
even on the operands' memory alignment (the same [3, 64] x [64, 32] product differs between
batch 1 and 2). A tree node's keys are gathered along its own path (its context, then its
ancestors root to itself), so that its j-th key is the one a decode row at its position reads as
its j-th: the same sum over L in the same order. Rows with the same L are computed together,
grouped by sequence: a group's keys and values are gathered once and broadcast over its rows
(a verification's k+1 rows, or up to BUCKET rows of a prompt, share them), which changes no product or sum of a row: a key hidden
from it adds a zero term (probability 0 times a finite value; a NaN or inf value of a LATER row's
key would make this row NaN too, as in the torch reference backend: zeroing those terms would
cost a large share of the attention). Cost: a gather and a few ops per
distinct (L, rows per sequence) per layer (a decode or a verification: 1-2; a prefill of T tokens:
T / BUCKET), and products of R x Hq x L x D floats, chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minispec.kernels.reference import visible_keys

from .metadata import BatchMetadata

BUCKET = 32  # keys per row are padded to a multiple of this
CHUNK_FLOATS = 1 << 22  # at most this many floats in one [rows, Hq, L, D] product


@dataclass
class Bucket:
    """The rows of one forward whose keys are padded to the same length L, as U sequence groups of
    Q rows each (sequences with another number of rows at this L form another bucket)."""

    rows: torch.Tensor | None  # [U*Q] row ids, group by group (None: all T rows of the forward, in order)
    slots: torch.Tensor  # [U, L] int64 slot of each key of the group's sequence (keys no row sees: any valid slot)
    visible: torch.Tensor  # [U, Q, L] bool


@dataclass
class InvariantPlan:
    """Everything but q and the pools, built once per forward and shared by its layers."""

    buckets: list[Bucket]
    sliding_window: int | None


def invariant_plan(meta: BatchMetadata, page_size: int | None, sliding_window: int | None) -> InvariantPlan:
    """Group the forward's rows by padded key count L = ceil((position + 1) / BUCKET) * BUCKET and
    by the keys they read, and the groups by (L, rows in the group), so that no group is padded.

    A row's keys are laid out by position, j = 0..position, whatever forward it is in: the rows of
    one sequence share its keys (slot of key j: page_size None, a prefill over the forward's own
    K/V: the sequence's first new row + j; else the page pool's slot through the block table). A
    tree node (tree_bits != 0) reads the context before its tree block and then its own ancestors,
    root to itself (the set bits in order: a parent precedes its children), so its j-th key is the
    one a decode row at its position reads as its j-th: each tree node is a group of its own."""
    dev = meta.positions.device
    starts = meta.query_start_loc.tolist()  # [B+1]
    lens = meta.seq_lens.tolist()  # [B]
    bits = [0] * starts[-1] if meta.tree_bits is None else meta.tree_bits.tolist()  # [T]
    tree_start = lens if meta.tree_start is None else meta.tree_start.tolist()  # [B]
    positions, key_maps, groups = [], {}, {}  # [T]; group -> key index of each j; (group, L) -> rows
    for b in range(len(lens)):
        for t in range(starts[b], starts[b + 1]):
            if bits[t]:  # a tree node: its context, then its path through the block
                path = [tree_start[b] + i for i in range(63) if bits[t] >> i & 1]
                position, group = tree_start[b] - 1 + len(path), (b, t)
                key_maps[group] = list(range(tree_start[b])) + path
            else:  # a token of a sequence (before its tree block, if any): key index = position
                position, group = lens[b] - starts[b + 1] + t, (b, -1)
            positions.append(position)
            groups.setdefault((group, -(-(position + 1) // BUCKET) * BUCKET), []).append(t)
    shapes: dict[tuple[int, int], list[tuple]] = {}  # (L, Q) -> groups
    for (group, L), rows in groups.items():
        shapes.setdefault((L, len(rows)), []).append(group)
    row_position = torch.tensor(positions, device=dev)  # [T]
    buckets = []
    for L, Q in sorted(shapes):
        members = shapes[L, Q]  # [U] (sequence, tree row or -1)
        flat = [t for g in members for t in groups[g, L]]  # [U*Q]
        rows = torch.tensor(flat, device=dev)  # [U*Q]
        j = torch.arange(L, device=dev)  # [L]
        visible = visible_keys(row_position[rows].view(len(members), Q, 1), j, sliding_window)  # [U, Q, L]
        keys = torch.stack([j if g not in key_maps else  # [U, L] key index of each j (past the path: any)
                            torch.tensor(key_maps[g] + [0] * (L - len(key_maps[g])), device=dev) for g in members])
        seq_ids = torch.tensor([b for b, _ in members], device=dev)  # [U]
        if page_size is None:
            slots = meta.query_start_loc.long()[seq_ids][:, None] + keys  # [U, L]
        else:
            pages = meta.block_tables.long()[seq_ids]  # [U, max_pages]
            page = pages.gather(1, (keys // page_size).clamp(max=pages.shape[1] - 1))  # [U, L]
            slots = page * page_size + keys % page_size  # [U, L]
        needed = visible.any(dim=1)  # [U, L]: keys some row of the group sees (the others may lie past the pool)
        everything = flat == list(range(len(positions)))
        buckets.append(Bucket(None if everything else rows, torch.where(needed, slots, slots[:, :1]), visible))
    return InvariantPlan(buckets, sliding_window)


def invariant_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: InvariantPlan,
                        sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D]; k_pool / v_pool [S, Hkv, D] (keys by slot, as `plan` addresses them).
    Returns [T, Hq, D] in q's dtype: softmax(sm_scale q k^T + mask) v per row, fp32 inside."""
    T, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    out = None if len(plan.buckets) == 1 and plan.buckets[0].rows is None else torch.empty_like(q)  # [T, Hq, D]
    for b in plan.buckets:
        U, Q, L = b.visible.shape
        keys = k_pool[b.slots].float().transpose(1, 2)  # [U, Hkv, L, D]
        values_t = v_pool[b.slots].float().permute(0, 2, 3, 1).contiguous()  # [U, Hkv, D, L]: L innermost
        q_b = (q if b.rows is None else q[b.rows]).float().view(U, Q, num_kv_heads, group, head_dim)  # [U, Q, Hkv, g, D]
        parts = []
        for us, qs in chunks(U, Q, L * num_q_heads * head_dim, CHUNK_FLOATS):  # bounds the products' memory
            # Dot products as multiply + sum over the last axis (D, then L): a fixed reduction per
            # output element, unlike a GEMM, whose rounding depends on the shapes and alignment.
            # A group's keys broadcast over its rows: [u, q, Hkv, g, 1, D] * [u, 1, Hkv, 1, L, D].
            scores = (q_b[us, qs, :, :, None, :] * keys[us, None, :, None]).sum(-1).mul_(sm_scale)  # [u, q, Hkv, g, L]
            scores.masked_fill_(~b.visible[us, qs, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # [u, q, Hkv, g, L]
            parts.append((probs[..., None, :] * values_t[us, None, :, None]).sum(-1))  # [u, q, Hkv, g, D]
        o = torch.cat([p.flatten(0, 1) for p in parts]) if len(parts) > 1 else parts[0]  # [U*Q, Hkv, g, D] ([U, Q, ...] if one)
        o = o.reshape(U * Q, num_q_heads, head_dim).to(q.dtype)  # [U*Q, Hq, D]
        if out is None:  # one bucket holding every row in order
            return o
        out[b.rows] = o  # several buckets: none holds every row, so each has its row ids
    return out


def chunks(U: int, Q: int, per_row: int, budget: int):
    """(group slice, row slice) pairs covering [U, Q] in order, each product holding at most
    `budget` floats (per_row of them per row): whole groups when one fits, else rows of one group."""
    if Q * per_row <= budget:
        step = budget // (Q * per_row)
        return [(slice(u, u + step), slice(None)) for u in range(0, U, step)]
    step = max(1, budget // per_row)
    return [(slice(u, u + 1), slice(i, i + step)) for u in range(U) for i in range(0, Q, step)]
