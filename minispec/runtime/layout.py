"""Where the packed new tokens of a forward go: rows, positions and pool slots.

Shared by the dynamic-shape forward (runner.py) and the static-shape one (static_shapes.py), so
both lay a batch out the same way: the core's `token_layout` (core/runner.py), then the rows
whose logits are wanted, the rows drawn on the device, and a tree's mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .transfers import Upload


def logit_rows(feeds: list, starts: np.ndarray) -> list[int]:
    """The rows whose logits each feed wants: its last num_logits rows, in feed order."""
    return [row for f, end in zip(feeds, starts[1:].tolist()) for row in range(end - f.num_logits, end)]


def drawn_rows(feeds: list, starts: np.ndarray) -> list[int]:
    """The rows of the tokens drawn on the device (each feed's last `drawn`), in feed order."""
    return [row for f, end in zip(feeds, starts[1:].tolist()) for row in range(end - f.drawn, end)]


def tree_layout(feeds: list, seq_lens: np.ndarray, starts: np.ndarray, positions: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """The tree mask of a forward (metadata.py): tree_start [B] (seq_len for a feed without a
    tree) and tree_bits [T]; writes each tree feed's node positions into positions [T], which
    must be what the attention mask assumes of them (kernels/paged_attention.py)."""
    tree_start = seq_lens.astype(np.int32)  # [B]
    bits = np.zeros(int(starts[-1]), dtype=np.int64)  # [T]
    for b, f in enumerate(feeds):
        if f.tree is not None:
            if len(f.tree.positions) != len(f.tokens) or len(f.tree.bits) != len(f.tokens):
                raise ValueError(f"a tree feed needs a position and a bit row per token ({len(f.tokens)})")
            if not 0 <= seq_lens[b] - f.tree.start <= 63:
                raise ValueError(f"a tree block holds 1..63 keys; this one starts at {f.tree.start} of {seq_lens[b]}")
            first_key = int(seq_lens[b]) - len(f.tokens)
            for key, (pos, row) in enumerate(zip(f.tree.positions, f.tree.bits), first_key):
                if pos != (f.tree.start - 1 + row.bit_count() if row else key):  # what a sliding window measures
                    raise ValueError(f"a tree feed's token at key {key} has position {pos}; a node's must be its block's "
                                     f"start - 1 + its depth (bits set: {row.bit_count()}), any other token's its key")
            tree_start[b] = f.tree.start
            positions[starts[b] : starts[b + 1]] = f.tree.positions
            bits[starts[b] : starts[b + 1]] = f.tree.bits
    return tree_start, bits


@dataclass
class Prepared:
    """A forward laid out on the host, its arrays in `upload` under `prefix` (`ModelRunner.prepare`);
    it runs once the upload is sent (`ModelRunner.run`). bucket: its static shape, or None for the
    dynamic path (then the launch sizes and whether it is a prefill are kept here)."""

    feeds: list  # runner.Feed
    upload: Upload
    prefix: str
    bucket: object | None
    num_rows: int  # rows the feeds' tokens fill
    max_query_len: int = 0
    max_seq_len: int = 0
    is_prefill: bool = False
    tree: bool = False
