"""ModelRunner: one model plus its own paged KV cache; turns "feed these tokens to these
sequences" into one batched forward pass.

Each call feeds every listed sequence its new tokens (a whole prompt, one decode token, or the
k+1 tokens a verification scores), writes their K/V into the sequence's pages, and returns the
logits of the last `num_logits` new tokens of each. The target and the draft each have a runner;
they share nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .kv_cache import BlockTable, KVCache
from .model import BatchMetadata


@dataclass
class Feed:
    """New tokens for one sequence: they take positions table.num_cached, table.num_cached + 1, ..."""

    table: BlockTable
    tokens: list[int]
    num_logits: int = 1  # logits wanted for this many of the last new tokens


def token_layout(q_lens: np.ndarray, cached: np.ndarray, tables: np.ndarray, page_size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the packed new tokens of B sequences go: starts [B+1] (sequence b's rows are
    starts[b]:starts[b+1]), and per token its position [T] and its pool slot [T] (page from the
    sequence's block table row in tables [B, P], times page_size, plus the offset in the page).
    q_lens, cached: [B] new and already cached tokens per sequence."""
    starts = np.concatenate([[0], np.cumsum(q_lens)])  # [B+1]
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)  # [T]
    positions = np.arange(starts[-1]) - starts[seq_of_token] + cached[seq_of_token]  # [T]
    slots = tables[seq_of_token, positions // page_size].astype(np.int64) * page_size + positions % page_size  # [T]
    return starts, positions, slots


class ModelRunner:
    def __init__(self, model: nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_positions = model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size  # the width of its logits

    def forward(self, feeds: list[Feed]) -> torch.Tensor:
        """One forward over all feeds -> fp32 logits [sum(num_logits), V], in feed order. Pages
        for the new positions are reserved here (KVPoolExhausted if too few are free; the
        scheduler reserves them beforehand, so a step never fails half-way)."""
        if not feeds:
            raise ValueError("forward needs at least one feed")
        cached = np.array([f.table.num_cached for f in feeds])  # [B]
        q_lens = np.array([len(f.tokens) for f in feeds])  # [B]
        for f, start, n in zip(feeds, cached, q_lens):
            if n == 0 or not 0 < f.num_logits <= n:
                raise ValueError(f"bad feed: {n} tokens, {f.num_logits} logits")
            if start + n > self.max_positions:
                raise ValueError(f"a feed reaches position {start + n - 1}, past the model's {self.max_positions}")
            f.table.reserve(int(start + n), self.cache.allocator)
        tables = np.zeros((len(feeds), max(len(f.table.pages) for f in feeds)), dtype=np.int64)  # [B, P]
        for b, f in enumerate(feeds):
            tables[b, : len(f.table.pages)] = f.table.pages
        starts, positions, slots = token_layout(q_lens, cached, tables, self.cache.page_size)  # [B+1], [T], [T]
        logit_rows = [row for f, end in zip(feeds, starts[1:]) for row in range(end - f.num_logits, end)]  # [N]
        input_ids = list(itertools.chain.from_iterable(f.tokens for f in feeds))  # [T]

        def tensor(values, dtype=torch.int64):
            return torch.as_tensor(np.asarray(values), dtype=dtype).to(self.device)

        meta = BatchMetadata(positions=tensor(positions), query_start_loc=tensor(starts, torch.int32),
                             seq_lens=tensor(cached + q_lens, torch.int32), max_query_len=int(q_lens.max()),
                             max_seq_len=int((cached + q_lens).max()), slot_mapping=tensor(slots),
                             block_tables=tensor(tables, torch.int32), logits_indices=tensor(logit_rows),
                             is_prefill=not cached.any())
        logits = self.model(tensor(input_ids), meta, self.cache.layers())  # [N, V]
        for f, n in zip(feeds, q_lens):
            f.table.num_cached += int(n)
        return logits
