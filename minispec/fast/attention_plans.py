"""Paged attention on CPU, batched: what the torch backend runs in place of the kernel's twin
(optional speed: skip on a first read; kernels/paged_attention.py's `paged_attention_ref` is the
simple version of the same math).

The twin loops over sequences: gather one sequence's pages, one masked softmax, next sequence.
On a CPU a decode row's cost is mostly its number of ops, not its arithmetic, and a decode batch
of B sequences would take B gathers, B score products and B softmaxes in every layer. Here the
sequences with few new tokens (decode, a k + 1 verification: at most BATCHED_MAX_QUERY_LEN)
are padded into one batch [B, Qm queries, L keys] and take one gather per pool, one matmul for
the scores, one softmax and one matmul for the output; longer ones (prefill chunks) loop as in
the twin. The indices of that batch (key slots, query rows, the visibility mask) depend on the
metadata alone, so `plan_paged_attention` builds them once per forward: the backend keeps the
plan in `BatchMetadata.attention_plan` and every layer reuses it.

Why the output stays exact. Every real query row takes the twin's math: fp32 scores
sm_scale <q, k_j> over the same keys, the same mask rule (`visible_keys`, kernels/reference.py:
causal, sliding window, tree), softmax, and the fp32 weighted sum of the same values. Padding
adds only masked terms: a padded key slot (past a shorter sequence's end) holds that sequence's
first key and is hidden from each of its queries, so its probability is exactly 0; a padded query
row repeats the sequence's last query and is dropped. When no key is hidden at all (a lone decode
row without a window) the mask is skipped, which changes nothing. The sums run in batched matmuls
rather than one per sequence, so a row may round differently in the last bit from the twin
(tests/test_cpu_fast_paths.py bounds the difference); the row-invariant backend
(model/invariant_attention.py) is the one whose rows are bitwise independent of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minispec.kernels.paged_attention import check_paged_args, check_tree_args
from minispec.kernels.reference import masked_attention, visible_keys

BATCHED_MAX_QUERY_LEN = 16  # sequences with at most this many new tokens share one padded softmax


@dataclass
class ShortQueryPlan:
    """Indices for the padded batch of short-query sequences (B of them, Qm = their largest q_len,
    L = their largest seq_len): key j of sequence b is pool slot slots[b, j]; padded query (b, i)
    repeats the sequence's last query (q row row_ids[b * Qm + i]) and sees visible[b, i]."""

    slots: torch.Tensor  # [B, L] int64
    visible: torch.Tensor  # [B, Qm, L] bool
    row_ids: torch.Tensor  # [B * Qm] int64
    keep: torch.Tensor | None  # [N] rows of the padded output that are real queries (None: all)
    keep_rows: torch.Tensor | None  # [N] their rows in q
    hidden: torch.Tensor | None  # [B, 1, 1, Qm, L] bool: ~visible, shaped for the scores; None when nothing is hidden
    in_order: bool  # row_ids is 0, 1, ..., T - 1 (every row of q) and nothing is padded: no gather or scatter of rows


@dataclass
class PagedPlan:
    """Host copies of the metadata plus the short-query batch's indices: everything
    `paged_attention_cpu` derives from the metadata alone."""

    starts: list[int]  # [B+1] query_start_loc
    seq_lens: list[int]  # [B]
    short: ShortQueryPlan | None
    long_seqs: list[int]  # sequences with more new tokens than BATCHED_MAX_QUERY_LEN (they loop)
    tree_start: list[int] | None = None  # [B] host copy of the tree mask's block starts
    tree_bits: torch.Tensor | None = None  # [T] int64


def plan_paged_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         page_size: int, sliding_window: int | None, tree_start: torch.Tensor | None = None,
                         tree_bits: torch.Tensor | None = None) -> PagedPlan:
    """Build the layer-independent indices of `paged_attention_cpu` for one batch."""
    starts, seq_lens_host = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    short = [seq for seq, n in enumerate(q_lens) if 0 < n <= BATCHED_MAX_QUERY_LEN]
    long_seqs = [seq for seq, n in enumerate(q_lens) if n > BATCHED_MAX_QUERY_LEN]
    tree_host = None if tree_start is None else tree_start.tolist()
    plan = (_short_query_plan(block_tables, seq_lens_host, starts, short, page_size, sliding_window, tree_host, tree_bits)
            if short else None)
    return PagedPlan(starts, seq_lens_host, plan, long_seqs, tree_host, tree_bits)


def _short_query_plan(block_tables, seq_lens: list[int], starts: list[int], seqs: list[int], page_size: int,
                      sliding_window: int | None, tree_start: list[int] | None = None,
                      tree_bits: torch.Tensor | None = None) -> ShortQueryPlan:
    """Padded key slots (past len_b: the sequence's first key, masked; unused slots may hold
    anything, even NaN), query rows and the visibility mask of query i of sequence b, which sits
    at seq_len_b - q_len_b + i and sees keys j <= it within the window. seq_lens / starts are host
    copies of the metadata, so the per-token index lists are built in Python."""
    device = block_tables.device
    B = len(seqs)
    q_lens = [starts[s + 1] - starts[s] for s in seqs]  # [B]
    lens = [seq_lens[s] for s in seqs]  # [B]
    Qm, L = max(q_lens), max(lens)
    key_pos = torch.arange(L, device=device)  # [L]
    tables = block_tables[torch.tensor(seqs, device=device)]  # [B, max_pages]
    slots = tables[:, key_pos // page_size].long() * page_size + key_pos % page_size  # [B, L]
    slots = torch.where(key_pos < torch.tensor(lens, device=device)[:, None], slots, slots[:, :1])
    rows = [starts[s] + min(i, n - 1) for s, n in zip(seqs, q_lens) for i in range(Qm)]  # [B * Qm]
    query_pos = [ln - n + min(i, n - 1) for ln, n in zip(lens, q_lens) for i in range(Qm)]  # [B * Qm]
    query_pos = torch.tensor(query_pos, device=device).view(B, Qm, 1)  # [B, Qm, 1]
    bits = block = None
    if tree_start is not None:  # keys in a tree block: only those whose bit the row has
        bits = tree_bits[torch.tensor(rows, device=device)].view(B, Qm, 1)  # [B, Qm, 1]
        block = torch.tensor([tree_start[s] for s in seqs], device=device).view(B, 1, 1)  # [B, 1, 1]
    visible = visible_keys(query_pos, key_pos, sliding_window, bits, block)  # [B, Qm, L] (keys past len_b lie past every query of b)
    keep = keep_rows = None
    if sum(q_lens) != B * Qm:  # padded queries (never in a decode batch)
        kept = [b * Qm + i for b, n in enumerate(q_lens) for i in range(n)]
        keep = torch.tensor(kept, device=device)
        keep_rows = torch.tensor([rows[j] for j in kept], device=device)
    in_order = keep is None and rows == list(range(starts[-1]))  # (false when longer sequences' rows are in q too)
    hidden = ~visible[:, None, None]
    return ShortQueryPlan(slots, visible, torch.tensor(rows, device=device), keep, keep_rows,
                          hidden if bool(hidden.any()) else None, in_order)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    validate: bool | None = None,
    tree_start: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
    plan: PagedPlan | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s result (kernels/paged_attention.py: same arguments and checks),
    with the short-query sequences batched (module docstring). Returns [T, Hq, D] in q's dtype.
    `plan`: this batch's `plan_paged_attention` (built here when None; a given plan already holds
    the tree mask)."""
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                     max_query_len, max_seq_len, sliding_window, validate)
    check_tree_args(q, seq_lens, tree_start, tree_bits, validate)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    if plan is None:
        plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, page_size, sliding_window,
                                    tree_start, tree_bits)
    group = q.shape[1] // num_kv_heads
    short = plan.short
    if short is not None and short.in_order:
        return batched_short_queries(q, k_cache, v_cache, short, sm_scale)  # every row of q, in order (a decode batch)
    out = torch.empty_like(q)  # [T, Hq, D]
    if short is not None:
        rows = batched_short_queries(q, k_cache, v_cache, short, sm_scale)  # [B * Qm, Hq, D]
        if short.keep is None:
            out[short.row_ids] = rows
        else:
            out[short.keep_rows] = rows[short.keep]
    for seq in plan.long_seqs:  # as the twin does
        q_start, q_end, seq_len = plan.starts[seq], plan.starts[seq + 1], plan.seq_lens[seq]
        pages = block_tables[seq, : -(-seq_len // page_size)].long()  # [n_pages]
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, Hkv, D]
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, Hkv, D]
        positions = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)  # [q_len]
        tree = None if plan.tree_start is None else (plan.tree_start[seq], plan.tree_bits[q_start:q_end])
        out[q_start:q_end] = masked_attention(q[q_start:q_end], keys, values, positions, group=group,
                                              sm_scale=sm_scale, sliding_window=sliding_window, tree=tree)
    return out


def batched_short_queries(q, k_cache, v_cache, plan: ShortQueryPlan, sm_scale) -> torch.Tensor:
    """Attention of the short-query sequences of `plan` with no Python loop over them: queries
    padded to [B, Qm], keys gathered by pool slot into [B, Hkv, L, D]; the same math as
    `masked_attention` (fp32). Returns the padded rows [B * Qm, Hq, D] in q's dtype (the caller
    keeps the real ones). Written in few ops (a decode row's ops are most of its cost on a CPU):
    one index_select per pool, scale and mask in place, no mask when nothing is hidden."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    B, Qm, L = plan.visible.shape
    group = num_q_heads // num_kv_heads
    slots = plan.slots.view(-1)  # [B * L]
    keys = k_cache.flatten(0, 1).index_select(0, slots).view(B, L, num_kv_heads, head_dim).transpose(1, 2).float()
    values = v_cache.flatten(0, 1).index_select(0, slots).view(B, L, num_kv_heads, head_dim).transpose(1, 2).float()
    q_f = (q if plan.in_order else q[plan.row_ids]).float()  # [B * Qm, Hq, D]
    q_f = q_f.view(B, Qm, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, g, Qm, D]
    q_f = q_f.reshape(B, num_kv_heads, group * Qm, head_dim)
    scores = torch.matmul(q_f, keys.transpose(-1, -2)).mul_(sm_scale)  # [B, Hkv, g * Qm, L]
    if plan.hidden is not None:
        scores.view(B, num_kv_heads, group, Qm, L).masked_fill_(plan.hidden, float("-inf"))
    out_b = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, Hkv, g * Qm, D]
    out_b = out_b.view(B, num_kv_heads, group, Qm, head_dim).permute(0, 3, 1, 2, 4)  # [B, Qm, Hkv, g, D]
    return out_b.reshape(B * Qm, num_q_heads, head_dim).to(q.dtype)
