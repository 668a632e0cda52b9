"""The one interface between the model and its kernels: a backend called with `BatchMetadata`.

A backend (`torch` reference or `triton` kernels, from `minispec_kernels`: the top-level
`kernels/` folder) writes the new K/V into the page pool and attends. It also runs the layer's
elementwise glue, fused on the Triton backend: the residual add with the RMSNorm after it
(`add_rmsnorm`), RoPE with the K/V write (`rope_write`) and SwiGLU's silu(gate) * up
(`silu_mul`); the torch and invariant backends run the kernels' torch twins, the model's own ops.
For paged attention the torch backend runs the twin's math batched over the sequences
(fast/attention_plans.py: on a CPU a decode's cost is its number of ops), its indices built once
per forward and kept in the metadata's `attention_plan`. Nothing is global: the metadata
(metadata.py) is passed into every forward.

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
    """Writes new K/V into the page pool and attends, and runs the fused layer glue, with either
    kernels or their torch twins."""

    def __init__(self, name: str | None = None):
        name = name or os.environ.get("MINISPEC_BACKEND") or ("triton" if torch.cuda.is_available() else "torch")
        if name not in ("triton", "torch", "invariant"):
            raise ValueError(f"unknown attention backend {name!r} (use 'triton', 'torch' or 'invariant')")
        from minispec_kernels import add_rmsnorm, flash_prefill, paged_attention, rope_write, silu_mul

        from ..fast.attention_plans import paged_attention_cpu, plan_paged_attention

        self.name = name
        if name == "triton":
            self._prefill, self._paged = flash_prefill.flash_prefill, paged_attention.paged_attention
            self._add_rmsnorm, self._rope_write = add_rmsnorm.add_rmsnorm, rope_write.rope_write
            self._silu_mul = silu_mul.silu_mul
        else:
            self._prefill, self._paged = flash_prefill.flash_prefill_ref, paged_attention.paged_attention_ref
            self._add_rmsnorm, self._rope_write = add_rmsnorm.add_rmsnorm_ref, rope_write.rope_write_ref
            self._silu_mul = silu_mul.silu_mul_ref
        if name == "torch":  # paged attention: the twin's math, batched over sequences (module docstring)
            self._paged, self._plan = paged_attention_cpu, plan_paged_attention

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, H]. residual <- x + residual IN PLACE, returns (rmsnorm(residual) *
        weight, residual); with residual None, (rmsnorm(x) * weight, x). kernels/add_rmsnorm.py."""
        return self._add_rmsnorm(x, residual, weight, eps)

    def rope_write(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: BatchMetadata) -> torch.Tensor:
        """qk: [T, Hq + Hkv, D] the query then key heads, v: [T, Hkv, D], cos / sin (signed):
        [T, 1, D]. Returns RoPE(qk), a new [T, Hq + Hkv, D], after writing its key heads and v
        into this layer's pools at meta.slot_mapping (if there is a cache). kernels/rope_write.py."""
        k_pool, v_pool = (None, None) if kv_cache is None else kv_cache
        slots = None if kv_cache is None else meta.slot_mapping
        return self._rope_write(qk, v, cos, sin, k_pool, v_pool, slots, validate=False)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> silu(gate) * up [T, I]. kernels/silu_mul.py."""
        return self._silu_mul(gate_up)

    def _invariant(self, q, k, v, kv_cache, meta: BatchMetadata, sm_scale, sliding_window) -> torch.Tensor:
        """The batch-invariant backend (invariant_attention.py): over this forward's own K/V for a
        prefill, else over the page pool; the key slots are built once per forward."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the invariant attention backend cannot be captured in a CUDA graph (it plans in Python)")
        if meta.is_prefill:
            pools, page_size = (k, v), None
        else:
            pools, page_size = (kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)), kv_cache[0].shape[1]
        plan = meta.attention_plan
        if not isinstance(plan, InvariantPlan) or plan.sliding_window != sliding_window:
            meta.attention_plan = invariant_plan(meta, page_size, sliding_window)
        return invariant_attention(q, *pools, meta.attention_plan, sm_scale)

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
        """q: [T, Hq, D], k, v: [T, Hkv, D], already written into kv_cache by `rope_write`;
        kv_cache: this layer's (k_pool, v_pool), each [num_pages, page_size, Hkv, D], or None.
        Returns [T, Hq, D]."""
        # The runner builds the metadata, so the kernels' value checks (which read device
        # tensors) are skipped here; shape and dtype checks still run on every call.
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
            if meta.attention_plan is None:
                meta.attention_plan = self._plan(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                                 kv_cache[0].shape[1], sliding_window, **tree)
            extra["plan"] = meta.attention_plan
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
