"""The production decoder: the core's Transformer (core/model.py, where the layers are written for
reading) with the production attention backend and the hidden states a drafter may ask for.

The layers (RMSNorm, RoPE, Attention, MLP, DecoderLayer) are the core's, re-exported here. The
loaders fuse q/k/v and gate/up (fast/fusion.py), and faster CPU variants and int8 layers are
swapped in after loading (minispec/fast/); ModelFeatures records what they did.
"""

from __future__ import annotations

import torch

from ..core.model import MLP, Attention, DecoderLayer, RMSNorm, rope_tables
from ..kernels.rope_write import apply_rope
from ..core import model as core
from .attention import AttentionBackend
from .config import ModelConfig
from .features import ModelFeatures
from .metadata import BatchMetadata

__all__ = ["MLP", "Attention", "DecoderLayer", "RMSNorm", "Transformer", "apply_rope", "rope_tables"]


class Transformer(ModelFeatures, core.Transformer):
    """The decoder. `forward(input_ids [T], meta, kv_caches) -> logits [N, vocab]`.
    (ModelFeatures: the marks optional rooms leave on a loaded model; the forward reads none.)"""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None):
        super().__init__(cfg, backend or AttentionBackend())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The core's forward: fp32 logits [N, vocab] for meta.logits_indices (all T rows when None).

        hidden_layers (a feature drafter's request): also return the residual stream entering
        each listed layer (HF's hidden_states[i]; i = num_layers is the last layer's output, before
        the final norm), for all T rows, concatenated in the order given: (logits, [T, len * hidden])."""
        if hidden_layers is None:
            return super().forward(input_ids, meta, kv_caches)
        taken = {}

        def take(i: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
            if i in hidden_layers:  # the stream entering layer i (a copy: layers add in place)
                taken[i] = x.clone() if residual is None else x + residual

        x, residual = self.run_layers(input_ids, meta, kv_caches, take)
        logits = self.logits(x, residual, meta)  # [N, vocab]
        return logits, torch.cat([taken[i] for i in hidden_layers], dim=-1)  # [N, vocab], [T, len * hidden]
