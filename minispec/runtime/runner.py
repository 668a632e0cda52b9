"""ModelRunner: one model plus its own paged KV cache; turns "feed these tokens to these
sequences" into one batched forward pass.

Each call feeds every listed sequence its new tokens (a whole prompt, one decode token, or the
k+1 tokens a speculative verification scores), writes their K/V into the sequence's pages, and
returns logits for the last `num_logits` new tokens of each sequence. The target and the draft
each have a runner; they share nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..core import runner as core
from ..core.runner import token_layout
from ..model.metadata import BatchMetadata
from .kv_cache import BlockTable, KVCache
from .layout import Prepared, drawn_rows, logit_rows, tree_layout
from .static_shapes import StaticShapes
from .transfers import Staging, Upload


@dataclass
class TreeFeed:
    """Tree nodes among a feed's new tokens (tree verification, tree drafting). The sequence's
    keys from index `start` on form its tree block (nodes fed now, or by an earlier forward).
    positions: the RoPE position of each new token (a node's is its root's + its depth);
    bits: per new token, bit j set = it sees tree key start + j (its ancestors and itself)."""

    start: int
    positions: list[int]
    bits: list[int]


@dataclass
class DrawnTree:
    """Tree nodes drawn on the device (a tree drafter's level, a tree it verifies): per drawn
    token (Feed.drawn, in feed order) its position and its mask row, where the host could not
    know them; None keeps the feed's. `ModelRunner.run` writes them over the feeds' placeholders
    (which must pass layout.tree_layout's check: a node's position is its block's start - 1 + its
    bits set)."""

    positions: torch.Tensor | None = None  # [sum drawn] int64
    bits: torch.Tensor | None = None  # [sum drawn] int64


@dataclass
class Feed(core.Feed):
    """The core's feed (new tokens for one sequence: they take key indices, and without a tree
    positions, table.num_cached, table.num_cached + 1, ...), with a tree and device-drawn tokens."""

    tree: TreeFeed | None = None
    drawn: int = 0  # the last `drawn` tokens were drawn on the device (`ModelRunner.run`); tokens holds placeholders


class ModelRunner(core.ModelRunner):
    """The core's runner (core/runner.py) with a forward split in two halves (`prepare` on the
    host, `run` on the device) so a step can send all its forwards' inputs in one upload, static
    shapes and CUDA graphs (static_shapes.py), and tree feeds."""

    def __init__(self, model: nn.Module, cache: KVCache):
        """model: a `Transformer`, or a feature drafter's `EagleModel` (same call signature)."""
        super().__init__(model, cache)
        self.static: StaticShapes | None = None  # set by `use_static_shapes`
        # Forwards run so far by path: a replayed CUDA graph, the static layout run eagerly, or the
        # dynamic path (prompts, and steps that admit a new request; what graphs cannot cover).
        self.forward_counts = {"graph": 0, "static": 0, "dynamic": 0}
        self.staging = Staging(self.device)  # every forward's metadata goes up in one copy (transfers.py)

    def use_static_shapes(self, query_len: int, max_batch: int, cuda_graphs: bool = False, trees: bool = False,
                          **model_args) -> None:
        """Run feeds of up to query_len tokens for up to max_batch sequences with static shapes
        (static_shapes.py; with trees, tree feeds too); with cuda_graphs, capture each shape now
        (a failed capture raises, naming the bucket). model_args: what every forward of this
        runner passes (baked into a graph)."""
        self.static = StaticShapes(self, query_len, max_batch, trees)
        if cuda_graphs:
            self.static.capture(model_args)

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make sure `table` has pages for positions < num_tokens (raises KVPoolExhausted)."""
        table.reserve(num_tokens, self.cache.allocator)

    def forward(self, feeds: list[Feed], upload: Upload | None = None, **model_args) -> torch.Tensor | tuple:
        """Run one forward over all feeds. Returns fp32 logits [sum(num_logits), vocab], in feed order
        (the model's whole return value when `model_args` ask it for more: they are passed on).
        upload: host arrays the caller wants on the device too; they travel in the forward's one
        upload (transfers.py) and are in upload.device afterwards.

        Pages missing for the new positions are allocated here (KVPoolExhausted if none are
        free; the scheduler reserves them beforehand so that a step never fails half-way)."""
        prepared = self.prepare(feeds, upload if upload is not None else Upload())
        self.staging.send(prepared.upload)
        return self.run(prepared, **model_args)

    def prepare(self, feeds: list[Feed], upload: Upload) -> Prepared:
        """The host's half of a forward: check the feeds, reserve their pages, lay them out into
        `upload` (a static bucket's layout, or the dynamic one) and count their tokens as cached.
        A step prepares all its forwards into one upload, sends it, then runs them in order."""
        if not feeds:
            raise ValueError("forward needs at least one feed")
        allocator = self.cache.allocator
        cached = [f.table.num_cached for f in feeds]
        q_lens = [len(f.tokens) for f in feeds]
        for f, start, n in zip(feeds, cached, q_lens):
            if n == 0 or not 0 < f.num_logits <= n or not 0 <= f.drawn <= n:
                raise ValueError(f"bad feed: {n} tokens, {f.num_logits} logits, {f.drawn} drawn")
            f.table.reserve(start + n, allocator)
        prefix = upload.scope()
        if self.static is not None and self.static.fits(feeds):  # decode / verification / draft steps
            prepared = self.static.prepare(feeds, upload, prefix)
        else:
            prepared = self._prepare(feeds, cached, q_lens, upload, prefix)
        for f, n in zip(feeds, q_lens):
            f.table.num_cached += n
        return prepared

    def run(self, prepared: Prepared, drawn: torch.Tensor | None = None, drawn_tree: DrawnTree | None = None,
            **model_args) -> torch.Tensor | tuple:
        """The device's half, once prepared.upload is sent: drawn [sum(f.drawn)] int64 holds the
        tokens drawn on the device, in feed order (Feed.drawn); drawn_tree, where those tokens are
        tree nodes placed on the device, their positions and mask rows (the feeds' are placeholders)."""
        sent, p = prepared.upload.device, prepared.prefix
        if drawn_tree is not None:  # (into the sent layout, this step's own copy, before either path reads it)
            for name, values in (("positions", drawn_tree.positions), ("tree_bits", drawn_tree.bits)):
                if values is not None:
                    sent[p + name].index_copy_(0, sent[p + "drawn_rows"], values)
        if prepared.bucket is not None:
            return self.static.run(prepared, drawn, **model_args)
        self.forward_counts["dynamic"] += 1
        meta = BatchMetadata(
            positions=sent[p + "positions"],
            query_start_loc=sent[p + "query_start_loc"],
            seq_lens=sent[p + "seq_lens"],
            max_query_len=prepared.max_query_len,
            max_seq_len=prepared.max_seq_len,
            slot_mapping=sent[p + "slot_mapping"],
            block_tables=sent[p + "block_tables"],
            logits_indices=sent[p + "logits_indices"],
            is_prefill=prepared.is_prefill,
        )
        if prepared.tree:
            meta.tree_start, meta.tree_bits = sent[p + "tree_start"], sent[p + "tree_bits"]
        input_ids = sent[p + "input_ids"]
        if drawn is not None:
            input_ids = input_ids.index_copy(0, sent[p + "drawn_rows"], drawn)
        return self.model(input_ids, meta, self.cache.layers(), **model_args)  # logits [N, vocab], ...

    def _prepare(self, feeds: list[Feed], cached: list[int], q_lens: list[int], upload: Upload, prefix: str
                 ) -> Prepared:
        """The dynamic-shape layout: metadata sized to exactly these feeds."""
        ps = self.cache.page_size
        # Host-side assembly in numpy (small arrays: far cheaper per op than torch tensors).
        # Per-sequence values come from Python lists (B of them); per-token values are vectorised,
        # so a long prompt costs no Python loop over its tokens.
        B = len(feeds)
        max_pages = max(len(f.table.pages) for f in feeds)
        block_tables = np.zeros((B, max_pages), dtype=np.int32)  # [B, max_pages], padding never read
        for b, f in enumerate(feeds):
            block_tables[b, : len(f.table.pages)] = f.table.pages
        q_lens_np, cached_np = np.array(q_lens), np.array(cached)  # [B], [B]
        seq_lens = cached_np + q_lens_np  # [B] context length including the new tokens
        starts, positions, slots = token_layout(q_lens_np, cached_np, block_tables, ps)  # [B+1], [T], [T]
        input_ids = np.fromiter(itertools.chain.from_iterable(f.tokens for f in feeds), np.int64, starts[-1])  # [T]
        tree = tree_layout(feeds, seq_lens, starts, positions) if any(f.tree is not None for f in feeds) else None
        arrays = {"input_ids": (input_ids, torch.int64), "positions": (positions, torch.int64),  # [T], [T]
                  "query_start_loc": (starts, torch.int32), "seq_lens": (seq_lens, torch.int32),  # [B+1], [B]
                  "slot_mapping": (slots, torch.int64),  # [T] pool slot = page * page_size + offset
                  "block_tables": (block_tables, torch.int32),  # [B, max_pages]
                  "logits_indices": (logit_rows(feeds, starts), torch.int64),  # [N]
                  "drawn_rows": (drawn_rows(feeds, starts), torch.int64)}  # [sum(drawn)]
        if tree is not None:
            arrays.update(tree_start=(tree[0], torch.int32), tree_bits=(tree[1], torch.int64))  # [B], [T]
        for name, (array, dtype) in arrays.items():
            upload.add(prefix + name, array, dtype)
        return Prepared(feeds, upload, prefix, None, int(starts[-1]), max(q_lens), int(seq_lens.max()),
                        not any(cached) and tree is None, tree is not None)
