"""BatchMetadata: where the packed new tokens of a forward sit, passed into every forward.

The core's metadata (core/model.py: positions, query start offsets, context lengths, page
slots and tables) plus what the production extensions attach to a forward: a tree of drafts'
attention mask, and the attention backend's per-forward plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import model as core


@dataclass
class BatchMetadata(core.BatchMetadata):
    """The core's fields (core/model.py; `is_prefill` is never set with a tree mask: the runner
    sets it False then, so the paged kernel applies the mask), and:

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
