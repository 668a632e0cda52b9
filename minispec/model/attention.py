"""The production attention backend: the core's (core/model.py) and what plugs into it.

The core's backend (`torch` reference or `triton` kernels, from `minispec.kernels`: the top-level
`kernels/` folder) writes the new K/V into the page pool and attends, and runs the layer's
elementwise glue, fused on the Triton backend: the residual add with the RMSNorm after it
(`add_rmsnorm`), RoPE with the K/V write (`rope_write`) and SwiGLU's silu(gate) * up
(`silu_mul`); the torch and invariant backends run the kernels' torch twins, the model's own ops.
This one adds a tree of drafts' mask (metadata.py's tree_start / tree_bits) to paged attention.
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

import torch

from ..core import model as core
from .invariant_attention import InvariantPlan, invariant_attention, invariant_plan
from .metadata import BatchMetadata


class AttentionBackend(core.AttentionBackend):
    """Writes new K/V into the page pool and attends, and runs the fused layer glue, with either
    kernels or their torch twins; "invariant" too (module docstring)."""

    names = ("triton", "torch", "invariant")

    def __init__(self, name: str | None = None):
        super().__init__(name)
        from ..fast.attention_plans import paged_attention_cpu, plan_paged_attention

        if self.name == "torch":  # paged attention: the twin's math, batched over sequences (module docstring)
            self._paged, self._plan = paged_attention_cpu, plan_paged_attention

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

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: BatchMetadata, sm_scale: float,
                 sliding_window: int | None) -> torch.Tensor:
        """The core's attention (q: [T, Hq, D], k, v: [T, Hkv, D] -> [T, Hq, D]), or the invariant one."""
        if self.name == "invariant":
            if kv_cache is None and not meta.is_prefill:
                raise ValueError("a forward with cached context needs a KV cache")
            return self._invariant(q, k, v, kv_cache, meta, sm_scale, sliding_window)
        return super().__call__(q, k, v, kv_cache, meta, sm_scale, sliding_window)

    def paged(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: BatchMetadata,
              sm_scale: float, sliding_window: int | None, **options) -> torch.Tensor:
        """The core's paged attention with the tree mask, and on "torch" this forward's plan."""
        tree = {} if meta.tree_start is None else {"tree_start": meta.tree_start, "tree_bits": meta.tree_bits}
        if self.name == "torch":  # indices shared by every layer of this forward
            if meta.attention_plan is None:
                meta.attention_plan = self._plan(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                                 kv_cache[0].shape[1], sliding_window, **tree)
            options["plan"] = meta.attention_plan
        return super().paged(q, kv_cache, meta, sm_scale, sliding_window, **options, **tree)
