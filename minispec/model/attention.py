"""The one interface between the model and attention: a backend called with `BatchMetadata`.

A backend (`torch` reference or `triton` kernels, from `minispec_kernels`: the top-level
`kernels/` folder) writes the new K/V into the page pool and attends. Nothing is global: the
metadata (metadata.py) is passed into every forward.

Backend choice: `triton` on CUDA, `torch` elsewhere; `MINISPEC_BACKEND=triton|torch` or the
`backend=` argument overrides it (tests run the Triton kernels on CPU under TRITON_INTERPRET=1).
`invariant` (invariant_attention.py) computes each query row alone, bitwise the same in any
batch: what a model with quantized activations needs (fast/int8.py switches any backend to it).
"""

from __future__ import annotations

import os

import torch

from .invariant_attention import InvariantPlan, invariant_attention, invariant_plan
from .metadata import BatchMetadata


class AttentionBackend:
    """Writes new K/V into the page pool and attends, with either kernels or their torch twins."""

    def __init__(self, name: str | None = None):
        name = name or os.environ.get("MINISPEC_BACKEND") or ("triton" if torch.cuda.is_available() else "torch")
        if name not in ("triton", "torch", "invariant"):
            raise ValueError(f"unknown attention backend {name!r} (use 'triton', 'torch' or 'invariant')")
        from minispec_kernels import flash_prefill, kv_write, paged_attention

        self.name = name
        if name == "triton":
            self._prefill, self._paged = flash_prefill.flash_prefill, paged_attention.paged_attention
            self._write = kv_write.write_kv
        else:
            self._prefill, self._paged = flash_prefill.flash_prefill_ref, paged_attention.paged_attention_ref
            self._write = kv_write.write_kv_ref
            self._ref_plan = paged_attention.ref_plan

    def _invariant(self, q, k, v, kv_cache, meta: BatchMetadata, sm_scale, sliding_window) -> torch.Tensor:
        """The batch-invariant backend (invariant_attention.py): over this forward's own K/V for a
        prefill, else over the page pool; the key slots are built once per forward."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the invariant attention backend cannot be captured in a CUDA graph (it plans in Python)")
        if meta.is_prefill:
            pools, page_size = (k, v), None
        else:
            pools, page_size = (kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)), kv_cache[0].shape[1]
        plan = meta.ref_plan
        if not isinstance(plan, InvariantPlan) or plan.sliding_window != sliding_window:
            meta.ref_plan = invariant_plan(meta, page_size, sliding_window)
        return invariant_attention(q, *pools, meta.ref_plan, sm_scale)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: BatchMetadata,
        sm_scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D]; kv_cache: this layer's (k_pool, v_pool), each
        [num_pages, page_size, Hkv, D], or None. Returns [T, Hq, D]."""
        # The runner builds the metadata, so the kernels' value checks (which read device
        # tensors) are skipped here; shape and dtype checks still run on every call.
        if kv_cache is not None:
            self._write(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, validate=False)
        if kv_cache is None and not meta.is_prefill:
            raise ValueError("a forward with cached context needs a KV cache")
        if self.name == "invariant":
            return self._invariant(q, k, v, kv_cache, meta, sm_scale, sliding_window)
        tree = {} if meta.tree_start is None else {"tree_start": meta.tree_start, "tree_bits": meta.tree_bits}
        if meta.is_prefill:  # no earlier context: attend over the contiguous new K/V
            return self._prefill(
                q, k, v, meta.query_start_loc, meta.max_query_len,
                sm_scale=sm_scale, sliding_window=sliding_window, validate=False,
            )
        extra = {}
        if self.name == "torch":  # indices shared by every layer of this forward
            if meta.ref_plan is None:
                meta.ref_plan = self._ref_plan(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                               kv_cache[0].shape[1], sliding_window, **tree)
            extra["plan"] = meta.ref_plan
        return self._paged(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_seq_len,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            validate=False,
            **extra,
            **tree,
        )
