"""The dense masked softmax behind the plain-torch reference twins.

`flash_prefill_ref` and `paged_attention_ref` gather each sequence's keys and values and call
`masked_attention`. These references are also minispec's CPU attention backend, so they loop
over sequences (not over heads or tokens) and compute in fp32.
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

    query_pos [Lq] are the key positions of the queries (keys sit at 0..Lk-1). Query head
    kv_head * group + r uses kv head kv_head: q is viewed as [Hkv, group * Lq, D] so that
    grouped-query attention needs no copy of K/V. tree: (tree_start, tree_bits [Lq] int64), the
    tree mask of paged_attention.py: keys >= tree_start are seen only where the query's bit is set.
    """
    num_queries, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    q_f = q.float().reshape(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, group, Lq, D]
    q_f = q_f.reshape(num_kv_heads, group * num_queries, head_dim)  # [Hkv, group * Lq, D]
    k_f = k.float().transpose(0, 1)  # [Hkv, Lk, D]
    v_f = v.float().transpose(0, 1)  # [Hkv, Lk, D]
    scores = torch.bmm(q_f, k_f.transpose(1, 2)) * sm_scale  # [Hkv, group * Lq, Lk]

    key_pos = torch.arange(num_keys, device=q.device)  # [Lk]
    distance = query_pos[:, None] - key_pos[None, :]  # [Lq, Lk]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    if tree is not None:
        start, bits = tree
        visible &= tree_visible(bits[:, None], key_pos[None, :], start)
    scores = scores.view(num_kv_heads, group, num_queries, num_keys).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * num_queries, num_keys)
    out = torch.bmm(probs, v_f)  # [Hkv, group * Lq, D]
    out = out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3)  # [Lq, Hkv, group, D]
    return out.reshape(num_queries, num_q_heads, head_dim).to(q.dtype)


def tree_visible(bits: torch.Tensor, key: torch.Tensor, start) -> torch.Tensor:
    """The tree mask (broadcast): key index `key` is visible to a row with ancestor bits `bits`
    when it lies before the tree block (key < start) or its bit key - start (0..62) is set."""
    return (key < start) | (((bits >> (key - start).clamp(0, 63).to(torch.int64)) & 1) != 0)
