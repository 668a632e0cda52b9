"""The dense masked softmax behind the plain-torch reference twins.

`flash_prefill_ref` and `paged_attention_ref` gather each sequence's keys and values and call
`masked_attention`: one fp32 masked softmax per sequence for all its new tokens and heads.
`visible_keys` is the whole mask rule (causal, sliding window, tree) in torch. The torch backend
prefills with `flash_prefill_ref` as it is; its paged attention (minispec/fast/attention_plans.py)
runs the same math and mask batched over sequences.
"""

import torch


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    *,
    group: int,
    sm_scale: float,
    sliding_window: int | None,
    tree: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(sm_scale q k^T + mask) v in fp32 for one sequence; q [Lq, Hq, D], k, v [Lk, Hkv, D].

    query_pos [Lq] are the key indices of the queries (keys sit at 0..Lk-1). Query head
    kv_head * group + r uses kv head kv_head: q is viewed as [Hkv, group * Lq, D] so that
    grouped-query attention needs no copy of K/V. tree: (tree_start, tree_bits [Lq] int64), the
    tree mask of paged_attention.py (`visible_keys` has the whole rule).
    """
    num_queries, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    q_f = q.float().reshape(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, group, Lq, D]
    q_f = q_f.reshape(num_kv_heads, group * num_queries, head_dim)  # [Hkv, group * Lq, D]
    k_f = k.float().transpose(0, 1)  # [Hkv, Lk, D]
    v_f = v.float().transpose(0, 1)  # [Hkv, Lk, D]
    scores = torch.bmm(q_f, k_f.transpose(1, 2)) * sm_scale  # [Hkv, group * Lq, Lk]

    key_pos = torch.arange(num_keys, device=q.device)  # [Lk]
    start, bits = tree if tree is not None else (None, None)
    visible = visible_keys(query_pos[:, None], key_pos[None, :], sliding_window,
                           None if bits is None else bits[:, None], start)  # [Lq, Lk]
    scores = scores.view(num_kv_heads, group, num_queries, num_keys).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * num_queries, num_keys)
    out = torch.bmm(probs, v_f)  # [Hkv, group * Lq, D]
    out = out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3)  # [Lq, Hkv, group, D]
    return out.reshape(num_queries, num_q_heads, head_dim).to(q.dtype)


def visible_keys(query: torch.Tensor, key: torch.Tensor, sliding_window: int | None,
                 bits: torch.Tensor | None = None, start=None) -> torch.Tensor:
    """The whole attention mask of the twins (broadcast; the kernels apply the same rule): key
    index `key` is visible to the new token at key index `query` when key <= query, it is in the
    window (`position_distance` < sliding_window) and, with a tree mask (bits: the row's ancestor
    bits, start: where the sequence's tree block begins), it lies before the tree block or its
    bit key - start (0..62) is set."""
    visible = key <= query
    if bits is not None:
        visible &= (key < start) | (((bits >> (key - start).clamp(0, 63).to(torch.int64)) & 1) != 0)
    if sliding_window is not None:
        visible &= position_distance(query, key, bits, start) < sliding_window
    return visible


def position_distance(query: torch.Tensor, key: torch.Tensor, bits: torch.Tensor | None = None, start=None
                      ) -> torch.Tensor:
    """Position of the query minus position of the key, what a sliding window measures. Key
    indices are positions except in a tree block: there a row with ancestor bits b (b != 0; 0 is
    a token before the block) sits at position start - 1 + popcount(b) (the root, at key start - 1,
    plus its depth; the runner checks this of every tree feed), a key before the block at its
    index, and its ancestor at key start + j popcount(b >> (j + 1)) levels above it."""
    if bits is None:
        return query - key
    before = start - 1 + popcount(bits) - key  # keys before the block
    above = popcount(bits >> (key - start + 1).clamp(0, 63).to(torch.int64))  # the row's ancestors
    return torch.where(bits == 0, query - key, torch.where(key < start, before, above))


def popcount(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 in 0..2^63 - 1 (bit-parallel sums: pairs, nibbles, bytes, then the
    eight bytes added into the lowest)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return (x + (x >> 8) + (x >> 16) + (x >> 24) + (x >> 32) + (x >> 40) + (x >> 48) + (x >> 56)) & 0x7F
