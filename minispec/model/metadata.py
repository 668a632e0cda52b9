"""BatchMetadata: where the packed new tokens of a forward sit, passed into every forward.

The model's forward takes a flat batch: the new tokens of several sequences packed one after
another (`[T]`), as paged attention needs them. This dataclass says where each sequence's tokens
start, how long its whole context is, and where its K/V live in the page pool. Nothing is global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchMetadata:
    """Where the T packed new tokens of B sequences sit.

    positions:       [T] int64, position of each new token in its sequence
    query_start_loc: [B+1] int32, sequence b's new tokens are rows query_start_loc[b]:query_start_loc[b+1]
    seq_lens:        [B] int32, context length of each sequence INCLUDING its new tokens
    max_query_len, max_seq_len: host ints (launch sizes; no device sync needed)
    slot_mapping:    [T] int64, pool slot (page * page_size + offset) for each new token's K/V, or None
    block_tables:    [B, max_pages] int32 page ids, or None when there is no KV cache
    logits_indices:  [N] int64 rows whose logits are wanted (None: all T rows)
    is_prefill:      True when every sequence starts at position 0 (no cached context), so
                     attention can run on the contiguous new K/V alone (never with a tree mask:
                     the runner sets it False then, so the paged kernel applies the mask)
    tree_start:      [B] int32, or None: the key index where sequence b's tree block starts
                     (seq_lens[b] when it has none); with tree_bits [T] int64, bit j of a new
                     token's row: it sees tree key tree_start[b] + j (its ancestors and itself).
                     Tree nodes sit at RoPE position tree_start[b] - 1 + depth, so `positions`
                     is no longer the key index; attention masks by key index, except that a
                     sliding window measures positions (kernels/paged_attention.py)
    attention_plan:  the attention backend's per-forward cache: whatever it derives from this
                     metadata alone (index tensors, host copies; fast/attention_plans.py's
                     PagedPlan on CPU, invariant_attention.py's InvariantPlan), built by the
                     first layer and reused by the others. None until then; whoever changes
                     the metadata's values in place sets it back to None
    """

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    is_prefill: bool = False
    attention_plan: object | None = None
    tree_start: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None

    @classmethod
    def for_prompts(cls, lengths: list[int], device: torch.device | str = "cpu") -> "BatchMetadata":
        """Metadata for a cache-free forward over whole prompts (parity tests, scoring)."""
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)  # [T]
        return cls(
            positions=positions,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),  # [B+1]
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),  # [B]
            max_query_len=max(lengths),
            max_seq_len=max(lengths),
            is_prefill=True,
        )
