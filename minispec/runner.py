"""ModelRunner: one model plus its own paged KV cache; turns "feed these tokens to these
sequences" into one batched forward pass.

Each call feeds every listed sequence its new tokens (a whole prompt, one decode token, or the
k+1 tokens a speculative verification scores), writes their K/V into the sequence's pages, and
returns logits for the last `num_logits` new tokens of each sequence. The target and the draft
each have a runner; they share nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import BatchMetadata
from .kv_cache import BlockTable, KVCache
from .model import Transformer


@dataclass
class Feed:
    """New tokens for one sequence: they take positions table.num_cached, table.num_cached + 1, ..."""

    table: BlockTable
    tokens: list[int]
    num_logits: int = 1  # logits wanted for this many of the last new tokens


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = model.embed_tokens.weight.device
        self.max_positions = model.cfg.max_position_embeddings

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make sure `table` has pages for positions < num_tokens (raises KVPoolExhausted)."""
        table.reserve(num_tokens, self.cache.allocator)

    def forward(self, feeds: list[Feed]) -> torch.Tensor:
        """Run one forward over all feeds. Returns fp32 logits [sum(num_logits), vocab], in feed order."""
        tokens, positions, slots, starts, seq_lens, logit_rows = [], [], [], [0], [], []
        for f in feeds:
            start, n = f.table.num_cached, len(f.tokens)
            if n == 0 or not 0 < f.num_logits <= n:
                raise ValueError(f"bad feed: {n} tokens, {f.num_logits} logits")
            f.table.reserve(start + n, self.cache.allocator)
            tokens += f.tokens
            positions += range(start, start + n)
            slots += f.table.slots(start, start + n)
            logit_rows += range(starts[-1] + n - f.num_logits, starts[-1] + n)
            starts.append(starts[-1] + n)
            seq_lens.append(start + n)
        max_pages = max(len(f.table.pages) for f in feeds)
        block_tables = [f.table.pages + [0] * (max_pages - len(f.table.pages)) for f in feeds]
        dev = self.device
        meta = BatchMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),  # [T]
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),  # [B+1]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),  # [B]
            max_query_len=max(len(f.tokens) for f in feeds),
            max_seq_len=max(seq_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),  # [T]
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),  # [B, max_pages]
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=dev),  # [N]
            is_prefill=all(f.table.num_cached == 0 for f in feeds),
        )
        logits = self.model(torch.tensor(tokens, dtype=torch.int64, device=dev), meta, self.cache.layers())
        for f in feeds:
            f.table.num_cached += len(f.tokens)
        return logits
