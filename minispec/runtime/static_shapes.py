"""Graph-ready steps: the same forward with static shapes, so that CUDA graphs can capture it.

At batch 1 a small target is bound by kernel launches on a GPU (~30 layers x a dozen launches per
forward); a CUDA graph replays them all with one launch. A graph fixes every shape and address, so
decode, verification and draft steps (each sequence feeds 1..Q tokens) are laid out per bucket:

    rows [0, B*Q):  sequence b's n_b tokens packed from row query_start_loc[b] (as the dynamic path
                    packs them), then all padding rows, which belong to B padding sequences of at
                    most Q rows each (a kernel launch covers max_query_len = Q rows per sequence:
                    one padding sequence of more rows would leave some uncomputed)
    metadata:       2B sequences (real ones, empty ones with 0 tokens, the padding ones), in
                    persistent per-bucket buffers filled in place before each forward
    launch sizes:   max_query_len = Q and max_seq_len = the runner's context limit, fixed per bucket

With `trees`, every bucket also carries the tree mask (tree_start [2B], tree_bits [B*Q]): a
tree verification of a fixed node budget is a static shape too; sequences without a tree get
tree_start = their length (no key in a tree block), so the same graph serves both.

Real sequences get exactly the metadata of the dynamic path (their rows, context lengths and block
tables), so their logits are the dynamic path's. The padding sequence starts at position 0, owns
only the scratch page (KVCache.scratch_page: its K/V writes land there) and its outputs are
dropped; so do the other padding sequences. Steps that feed a sequence more than Q tokens (prompts) take the dynamic path.

On CUDA each bucket's forward is captured once (`capture`) and replayed; on CPU, and wherever a
capture fails (one warning, then eager for good), the static forward runs eagerly: the same
layout, so tests on CPU check what the graph replays (tests/test_graphs.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..model.metadata import BatchMetadata
from .layout import logit_rows, token_layout, tree_layout
from .transfers import Upload

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Bucket:
    """Persistent inputs of one static shape: B sequence slots of up to Q new tokens each."""

    batch: int
    query_len: int
    input_ids: torch.Tensor  # [B*Q] int64
    meta: BatchMetadata  # positions [B*Q], query_start_loc [2B+1], seq_lens [2B], slot_mapping [B*Q], block_tables [2B, P]
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    output: object | None = None  # what the captured forward returned (its buffers are rewritten by replay)


class StaticShapes:
    """The static-shape forward of one ModelRunner (see the module docstring)."""

    def __init__(self, runner, query_len: int, max_batch: int, trees: bool = False):
        self.runner = runner
        self.query_len = query_len
        self.trees = trees  # buckets carry the tree mask
        self.batches = [b for b in BATCH_BUCKETS if b < max_batch] + [b for b in BATCH_BUCKETS if b >= max_batch][:1]
        # Block-table width: a real sequence's pages, or a padding sequence's Q rows (all on the scratch page).
        ps = runner.cache.page_size
        self.pages_per_seq = max(-(-runner.max_positions // ps), -(-query_len // ps))
        self.buckets: dict[int, Bucket] = {}
        self.graph_args: dict | None = None  # the model_args the graphs were captured with
        self.graphs_failed = False

    def fits(self, feeds) -> bool:
        """Feeds a bucket can hold: few enough, short enough, trees only with `trees`, and no key
        past the block-table width (a tree's slots at the end of the context run dynamically)."""
        width = self.pages_per_seq * self.runner.cache.page_size
        return (len(feeds) <= self.batches[-1] and max(len(f.tokens) for f in feeds) <= self.query_len
                and (self.trees or all(f.tree is None for f in feeds))
                and all(f.table.num_cached + len(f.tokens) <= width for f in feeds))

    def bucket(self, batch: int) -> Bucket:
        size = next(b for b in self.batches if b >= batch)
        if size not in self.buckets:
            dev, T, seqs = self.runner.device, size * self.query_len, 2 * size  # (size real slots, size padding)
            meta = BatchMetadata(
                positions=torch.zeros(T, dtype=torch.int64, device=dev),
                query_start_loc=torch.zeros(seqs + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.zeros(seqs, dtype=torch.int32, device=dev),
                max_query_len=self.query_len,
                max_seq_len=self.runner.max_positions,
                slot_mapping=torch.zeros(T, dtype=torch.int64, device=dev),
                block_tables=torch.zeros(seqs, self.pages_per_seq, dtype=torch.int32, device=dev),
                logits_indices=None,  # every row: the real ones are picked afterwards
            )
            if self.trees:
                meta.tree_start = torch.zeros(seqs, dtype=torch.int32, device=dev)  # [2B]
                meta.tree_bits = torch.zeros(T, dtype=torch.int64, device=dev)  # [B*Q]
            self.buckets[size] = Bucket(size, self.query_len, torch.zeros(T, dtype=torch.int64, device=dev), meta)
        return self.buckets[size]

    def fill(self, bucket: Bucket, feeds, upload: Upload | None = None) -> tuple[torch.Tensor, int]:
        """Write the feeds into the bucket's buffers: the host lays them out, one upload carries
        them (with whatever else the caller put in `upload`: transfers.py), device copies put them
        in place. Returns (logit rows [N] on the device, how many rows the feeds' tokens fill)."""
        cache, ps = self.runner.cache, self.runner.cache.page_size
        B, Q = bucket.batch, bucket.query_len
        q_lens = np.zeros(2 * B, dtype=np.int64)
        cached = np.zeros(2 * B, dtype=np.int64)
        q_lens[: len(feeds)] = [len(f.tokens) for f in feeds]
        cached[: len(feeds)] = [f.table.num_cached for f in feeds]
        padding = B * Q - q_lens[:B].sum()  # every row left, Q at most per padding sequence
        q_lens[B:] = np.clip(padding - Q * np.arange(B), 0, Q)
        tables = np.full((2 * B, self.pages_per_seq), cache.scratch_page, dtype=np.int32)
        for b, f in enumerate(feeds):  # pages past this runner's context (a draft's reservation for the target's) are never read
            pages = f.table.pages[: self.pages_per_seq]
            tables[b, : len(pages)] = pages
        starts, positions, slots = token_layout(q_lens, cached, tables, ps)  # [2B+1], [B*Q], [B*Q]
        ids = np.zeros(B * Q, dtype=np.int64)
        ids[: starts[len(feeds)]] = [t for f in feeds for t in f.tokens]
        m = bucket.meta
        arrays = {"static_input_ids": (bucket.input_ids, ids), "static_query_start_loc": (m.query_start_loc, starts),
                  "static_seq_lens": (m.seq_lens, cached + q_lens), "static_slot_mapping": (m.slot_mapping, slots),
                  "static_block_tables": (m.block_tables, tables)}
        if self.trees:  # (writes the nodes' positions into positions first)
            tree_start, tree_bits = tree_layout(feeds, cached + q_lens, starts, positions)
            arrays.update(static_tree_start=(m.tree_start, tree_start), static_tree_bits=(m.tree_bits, tree_bits))
        arrays["static_positions"] = (m.positions, positions)
        upload = upload if upload is not None else Upload()
        for name, (buf, array) in arrays.items():
            upload.add(name, array, buf.dtype)
        upload.add("static_logit_rows", logit_rows(feeds, starts))
        sent = self.runner.staging.send(upload)
        for name, (buf, _) in arrays.items():
            buf.copy_(sent[name])  # (device to device)
        m.ref_plan = None  # the torch backend's host-side plan is rebuilt from the new values
        return sent["static_logit_rows"], int(starts[len(feeds)])

    def forward(self, feeds, upload: Upload | None = None, **model_args):
        """The runner's forward for feeds that fit a bucket; returns what the dynamic path returns."""
        bucket = self.bucket(len(feeds))
        rows, fed = self.fill(bucket, feeds, upload)
        if bucket.graph is not None and model_args == self.graph_args:
            bucket.graph.replay()
            out = bucket.output
            self.runner.forward_counts["graph"] += 1
        else:
            out = self.runner.model(bucket.input_ids, bucket.meta, self.runner.cache.layers(), **model_args)
            self.runner.forward_counts["static"] += 1
        if isinstance(out, tuple):  # (logits over every row, hidden states of every row)
            return out[0][rows], out[1][:fed]
        return out[rows]

    def capture(self, model_args: dict | None = None) -> None:
        """Capture one CUDA graph per bucket (the padding sequence fills every row while capturing,
        writing only the scratch page). Any failure: one warning, and every bucket stays eager."""
        model_args = model_args or {}
        self.graph_args = model_args
        try:
            for batch in self.batches:
                bucket = self.bucket(batch)
                self.fill(bucket, [])
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
                    for _ in range(2):
                        self.runner.model(bucket.input_ids, bucket.meta, self.runner.cache.layers(), **model_args)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    output = self.runner.model(bucket.input_ids, bucket.meta, self.runner.cache.layers(), **model_args)
                bucket.graph, bucket.output = graph, output
        except Exception as e:  # noqa: BLE001 - any capture problem means: run eagerly
            for bucket in self.buckets.values():
                bucket.graph = bucket.output = None
            self.graphs_failed = True
            warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); running the static-shape "
                          "steps eagerly", RuntimeWarning, stacklevel=2)
