"""Graph-ready steps: the same forward with static shapes, so that CUDA graphs can capture it.

At batch 1 a small model is bound by kernel launches on a GPU (~30 layers x a dozen launches per
forward); a CUDA graph replays them all with one launch. A graph fixes every shape and address, so
decode, verification and draft steps (each sequence feeds 1..Q tokens) are laid out per bucket,
one bucket per (batch size B, query length Q), B from BATCH_BUCKETS and Q from the runner's
query lengths (the feeds its steps really make: a target's k+1, a drafter's 1-token chain steps,
its catch-up of up to k+1 tokens, a tree level's frontier); a forward takes the smallest bucket
that holds it:

    rows [0, B*Q):  sequence b's n_b tokens packed from row query_start_loc[b] (as the dynamic path
                    packs them), then all padding rows, which belong to B padding sequences of at
                    most Q rows each (a kernel launch covers max_query_len = Q rows per sequence:
                    one padding sequence of more rows would leave some uncomputed)
    metadata:       2B sequences (real ones, empty ones with 0 tokens, the padding ones), in
                    persistent per-bucket buffers filled in place before each forward
    row inputs:     a model argument given per fed row (an EAGLE head's features [n, W]) is
                    copied into a persistent per-bucket buffer [B*Q, W], one per name and width
    launch sizes:   max_query_len = Q and max_seq_len = the runner's context limit, fixed per bucket

With `trees`, every bucket also carries the tree mask (tree_start [2B], tree_bits [B*Q]): a
tree verification of a fixed node budget (or a drafter's tree level) is a static shape too;
sequences without a tree get tree_start = their length (no key in a tree block), so the same graph
serves both.

Real sequences get exactly the metadata of the dynamic path (their rows, context lengths and block
tables), so their logits are the dynamic path's. The padding sequence starts at position 0, owns
only the scratch page (KVCache.scratch_page: its K/V writes land there) and its outputs are
dropped; so do the other padding sequences. Steps that feed a sequence more than the largest Q
tokens (prompts) take the dynamic path.

On CUDA each bucket's forward is captured once (`capture`) per variant of the model's arguments
(their non-tensor values and row-input widths: an EAGLE head's catch-up, which projects target
features, and its chained steps, which do not, are two graphs) and replayed. A capture that fails
raises, naming the runner and the bucket: a silent eager fallback would leave a GPU run launch-bound
without saying so. On CPU the static forward runs eagerly: the same layout, so tests on CPU check
what the graph replays (tests/test_graphs.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..model.metadata import BatchMetadata
from ..core.runner import token_layout
from .layout import Prepared, drawn_rows, logit_rows, tree_layout
from .transfers import Upload

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class RowInput:
    """A model argument given per fed row: a tensor [rows, width] of dtype. In a capture's
    variants it stands for the tensor (its values come with each forward)."""

    width: int
    dtype: torch.dtype


@dataclass
class Bucket:
    """Persistent inputs of one static shape: B sequence slots of up to Q new tokens each."""

    batch: int
    query_len: int
    input_ids: torch.Tensor  # [B*Q] int64
    meta: BatchMetadata  # positions [B*Q], query_start_loc [2B+1], seq_lens [2B], slot_mapping [B*Q], block_tables [2B, P]
    row_inputs: dict[tuple[str, RowInput], torch.Tensor] = field(default_factory=dict)  # [B*Q, width] each
    # Per variant of the model's arguments (`variant`): the CUDA graph and what its captured forward
    # returned (buffers that each replay rewrites).
    graphs: dict[tuple, tuple[object, object]] = field(default_factory=dict)


def variant(model_args: dict) -> tuple:
    """What a captured graph fixes of the model's arguments: the non-tensor values, and the width
    and dtype of each row input (a tensor, or a RowInput standing for one)."""
    as_key = lambda v: RowInput(v.shape[-1], v.dtype) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return tuple(sorted((name, as_key(v)) for name, v in model_args.items()))


class StaticShapes:
    """The static-shape forward of one ModelRunner (see the module docstring).

    query_len: the query lengths Q of its buckets (one int or several). role: "target" or "draft"
    (what a capture error names). carry_at_logit_rows: the model's second output (a tuple return)
    comes at the logit rows, as an EAGLE head's g does; else at every fed row, as the target's
    features do."""

    def __init__(self, runner, query_len: int | tuple[int, ...], max_batch: int, trees: bool = False,
                 role: str = "target", carry_at_logit_rows: bool = False):
        self.runner = runner
        self.query_lens = sorted({query_len} if isinstance(query_len, int) else set(query_len))
        if not self.query_lens or self.query_lens[0] < 1:
            raise ValueError(f"static shapes need query lengths >= 1, got {query_len}")
        self.trees = trees  # buckets carry the tree mask
        self.role = role
        self.carry_at_logit_rows = carry_at_logit_rows
        self.batches = [b for b in BATCH_BUCKETS if b < max_batch] + [b for b in BATCH_BUCKETS if b >= max_batch][:1]
        # Block-table width: a real sequence's pages, or a padding sequence's Q rows (all on the scratch page).
        ps = runner.cache.page_size
        self.pages_per_seq = max(-(-runner.max_positions // ps), -(-self.query_len // ps))
        self.buckets: dict[tuple[int, int], Bucket] = {}  # by (batch, query_len)
        self.pool = None  # the CUDA memory pool this runner's graphs share (they replay one at a time)

    @property
    def query_len(self) -> int:
        """The largest query length: a feed of more tokens runs dynamically."""
        return self.query_lens[-1]

    def fits(self, feeds) -> bool:
        """Feeds a bucket can hold: few enough, short enough, trees only with `trees`, and no key
        past the block-table width (a tree's slots at the end of the context run dynamically)."""
        width = self.pages_per_seq * self.runner.cache.page_size
        return (len(feeds) <= self.batches[-1] and max(len(f.tokens) for f in feeds) <= self.query_len
                and (self.trees or all(f.tree is None for f in feeds))
                and all(f.table.num_cached + len(f.tokens) <= width for f in feeds))

    def bucket(self, batch: int, query_len: int | None = None) -> Bucket:
        """The smallest bucket holding `batch` feeds of up to `query_len` tokens (None: the largest Q)."""
        size = next(b for b in self.batches if b >= batch)
        Q = next(q for q in self.query_lens if q >= (query_len or self.query_len))
        if (size, Q) not in self.buckets:
            dev, T, seqs = self.runner.device, size * Q, 2 * size  # (size real slots, size padding)
            meta = BatchMetadata(
                positions=torch.zeros(T, dtype=torch.int64, device=dev),
                query_start_loc=torch.zeros(seqs + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.zeros(seqs, dtype=torch.int32, device=dev),
                max_query_len=Q,
                max_seq_len=self.runner.max_positions,
                slot_mapping=torch.zeros(T, dtype=torch.int64, device=dev),
                block_tables=torch.zeros(seqs, self.pages_per_seq, dtype=torch.int32, device=dev),
                logits_indices=None,  # every row: the real ones are picked afterwards
            )
            if self.trees:
                meta.tree_start = torch.zeros(seqs, dtype=torch.int32, device=dev)  # [2B]
                meta.tree_bits = torch.zeros(T, dtype=torch.int64, device=dev)  # [B*Q]
            self.buckets[size, Q] = Bucket(size, Q, torch.zeros(T, dtype=torch.int64, device=dev), meta)
        return self.buckets[size, Q]

    def prepare(self, feeds, upload: Upload, prefix: str, bucket: Bucket | None = None) -> Prepared:
        """Lay the feeds out in the smallest bucket that holds them (or the one given), into
        `upload` under `prefix`; `run` puts them in the bucket's buffers once the upload is sent."""
        bucket = bucket or self.bucket(len(feeds), max(len(f.tokens) for f in feeds))
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
        arrays = {"input_ids": ids, "query_start_loc": starts, "seq_lens": cached + q_lens, "slot_mapping": slots,
                  "block_tables": tables}
        if self.trees:  # (writes the nodes' positions into positions first)
            arrays["tree_start"], arrays["tree_bits"] = tree_layout(feeds, cached + q_lens, starts, positions)
        arrays["positions"] = positions
        buffers = self.buffers(bucket)
        for name, array in arrays.items():
            upload.add(prefix + name, array, buffers[name].dtype)
        upload.add(prefix + "logit_rows", logit_rows(feeds, starts))
        upload.add(prefix + "drawn_rows", drawn_rows(feeds, starts))
        return Prepared(feeds, upload, prefix, bucket, int(starts[len(feeds)]))

    @staticmethod
    def buffers(bucket: Bucket) -> dict[str, torch.Tensor]:
        """The bucket's persistent inputs by name (what a graph reads)."""
        m = bucket.meta
        out = {"input_ids": bucket.input_ids, "query_start_loc": m.query_start_loc, "seq_lens": m.seq_lens,
               "slot_mapping": m.slot_mapping, "block_tables": m.block_tables, "positions": m.positions}
        if m.tree_start is not None:
            out.update(tree_start=m.tree_start, tree_bits=m.tree_bits)
        return out

    def load(self, prepared: Prepared, drawn: torch.Tensor | None = None) -> None:
        """Copy a sent layout into its bucket's buffers (device to device), and the tokens drawn on
        the device into their rows."""
        sent, p = prepared.upload.device, prepared.prefix
        for name, buf in self.buffers(prepared.bucket).items():
            buf.copy_(sent[p + name])
        if drawn is not None:
            prepared.bucket.input_ids.index_copy_(0, sent[p + "drawn_rows"], drawn)
        prepared.bucket.meta.attention_plan = None  # a backend's per-forward plan is rebuilt from the new values

    def fill(self, bucket: Bucket, feeds) -> None:
        """Write feeds into a bucket at once (one upload of their own): capture's padding-only fill."""
        upload = Upload()
        prepared = self.prepare(feeds, upload, upload.scope(), bucket)
        self.runner.staging.send(upload)
        self.load(prepared)

    def bind(self, bucket: Bucket, model_args: dict, num_rows: int | None = None) -> dict:
        """The model's arguments with each row input swapped for the bucket's persistent buffer
        [B*Q, width], its first num_rows rows (the fed tokens') written from the tensor given
        (a RowInput, when capturing: nothing to write). Padding rows keep stale values: their
        outputs are dropped."""
        bound = {}
        for name, value in model_args.items():
            if not isinstance(value, (torch.Tensor, RowInput)):
                bound[name] = value
                continue
            spec = value if isinstance(value, RowInput) else RowInput(value.shape[-1], value.dtype)
            key = (name, spec)
            if key not in bucket.row_inputs:
                rows = bucket.batch * bucket.query_len
                bucket.row_inputs[key] = torch.zeros(rows, spec.width, dtype=spec.dtype, device=self.runner.device)
            buf = bucket.row_inputs[key]  # [B*Q, width]
            if isinstance(value, torch.Tensor):
                if value.shape[0] != num_rows:
                    raise ValueError(f"model argument {name!r} has {value.shape[0]} rows; "
                                     f"the feeds have {num_rows} tokens")
                buf[:num_rows].copy_(value)
            bound[name] = buf
        return bound

    def run(self, prepared: Prepared, drawn: torch.Tensor | None = None, **model_args):
        """The runner's forward for feeds that fit a bucket, once prepared.upload is sent; returns
        what the dynamic path returns."""
        self.load(prepared, drawn)
        bucket, fed = prepared.bucket, prepared.num_rows
        rows = prepared.upload.device[prepared.prefix + "logit_rows"]
        args = self.bind(bucket, model_args, fed)
        captured = bucket.graphs.get(variant(model_args))
        if captured is not None:
            graph, out = captured
            graph.replay()
            self.runner.forward_counts["graph"] += 1
        else:
            out = self.runner.model(bucket.input_ids, bucket.meta, self.runner.cache.layers(), **args)
            self.runner.forward_counts["static"] += 1
        # Rows are picked (copied) at once: another graph's replay may reuse this one's output memory.
        if isinstance(out, tuple):  # (logits over every row, the second output over every row)
            return out[0][rows], (out[1][rows] if self.carry_at_logit_rows else out[1][:fed].clone())
        return out[rows]

    def capture(self, variants: dict | list[dict] | None = None) -> None:
        """Capture one CUDA graph per bucket and variant of the model's arguments (a dict of them,
        row inputs as RowInput; every forward of this runner passes one of these). The padding
        sequences fill every row while capturing, writing only the scratch page. A failure raises
        a RuntimeError naming the runner and the bucket."""
        variants = [variants or {}] if not isinstance(variants, list) else variants
        for batch, Q, model_args in itertools.product(self.batches, self.query_lens, variants):
            bucket = self.bucket(batch, Q)
            try:
                bucket.graphs[variant(model_args)] = self.capture_one(bucket, model_args)
            except Exception as e:
                args = ", ".join(f"{name}={value}" for name, value in variant(model_args)) or "no model arguments"
                raise RuntimeError(f"CUDA graph capture failed for the {self.role} runner's bucket of batch {batch}, "
                                   f"query length {Q} ({args}): {type(e).__name__}: {e}") from e

    def capture_one(self, bucket: Bucket, model_args: dict) -> tuple[object, object]:
        """(the graph, its output) of one bucket's forward with these arguments."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.fill(bucket, [])
        args = self.bind(bucket, model_args)
        forward = lambda: self.runner.model(bucket.input_ids, bucket.meta, self.runner.cache.layers(), **args)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        return graph, output
