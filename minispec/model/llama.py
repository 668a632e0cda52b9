"""A Llama-family decoder (Llama, Mistral, Qwen2) written for reading.

x -> [RMSNorm -> GQA attention with RoPE -> +x] -> [RMSNorm -> SwiGLU MLP -> +x] ... -> RMSNorm -> logits

The layers carry (x, residual) as vLLM does: a layer returns its MLP's output x apart from the
residual stream before it, and the next RMSNorm adds the two (`backend.add_rmsnorm`), so that on
the Triton backend the add and the norm are one kernel. The same for RoPE and the K/V write
(`backend.rope_write`) and SwiGLU's silu(gate) * up (`backend.silu_mul`); the torch backend runs
the same math as plain torch ops, bit for bit what `x = x + sublayer(norm(x))` computes.

The forward pass runs on a flat batch of T new tokens from B sequences (see `BatchMetadata`);
attention is the only place where sequences interact with their own past, and it goes through
`AttentionBackend`, so the paged KV cache and the Triton kernels plug in without touching this
file. Module names match Hugging Face's so a checkpoint's state dict loads as it is.
The draft model is this same class with a smaller config. The layers are plain `nn.Linear`;
the loaders fuse q/k/v and gate/up (fast/fusion.py), and faster CPU variants and int8 layers
are swapped in after loading (minispec/fast/).
"""

from __future__ import annotations

import torch
from torch import nn

from minispec_kernels._checks import SUPPORTED_HEAD_DIMS
from minispec_kernels.add_rmsnorm import rmsnorm_ref
from minispec_kernels.silu_mul import silu_mul_ref

from .attention import AttentionBackend
from .metadata import BatchMetadata
from .config import ModelConfig, rope_inv_freq
from .features import ModelFeatures


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in fp32; in bf16 / fp16 rounded to the
    dtype before the weight multiplies it (HF's order; `rmsnorm_ref` in kernels/add_rmsnorm.py).
    A decoder layer calls `backend.add_rmsnorm` with this module's weight and eps instead."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_ref(x, self.weight, self.eps)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin_signed for `apply_rope` at `positions` [...] -> two [..., 1, D] tensors (the 1
    broadcasts over heads): angle_i = position * inv_freq_i, repeated over both halves of D."""
    freqs = positions.float()[..., None] * inv_freq  # [..., D/2]
    cos = torch.cat((freqs, freqs), dim=-1).cos()[..., None, :].to(dtype)  # [..., 1, D]
    sin = freqs.sin()
    return cos, torch.cat((-sin, sin), dim=-1)[..., None, :].to(dtype)  # [..., 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF / GPT-NeoX layout: x * cos + rotate_half(x) * sin, where
    rotate_half([x1, x2]) = [-x2, x1] on the last axis. Written as x * cos + roll(x) * sin_signed
    with roll([x1, x2]) = [x2, x1] and sin_signed = [-sin, sin] (the same products, fewer ops).
    x: [T, H, D] (any strides); cos, sin_signed: [T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    """GQA attention; q/k/v read `in_features` (hidden_size unless given: the EAGLE layer's are 2x).
    q_proj / k_proj / v_proj as in HF checkpoints; the loaders fuse them into one qkv_proj
    (fast/fusion.py), which `project` uses when it is there."""

    def __init__(self, cfg: ModelConfig, in_features: int | None = None):
        super().__init__()
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if d not in SUPPORTED_HEAD_DIMS:  # refused at load, not at the first forward
            raise ValueError(f"head_dim {d} is not supported by the attention kernels (supported: {SUPPORTED_HEAD_DIMS})")
        width = in_features or cfg.hidden_size
        self.q_proj = nn.Linear(width, hq * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(width, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(width, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_proj: nn.Linear | None = None  # q, k, v in one matmul, once fused
        self.qkv_sizes = [hq * d, hkv * d, hkv * d]  # widths of q, k, v in `project`'s output

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> q, k and v side by side, [..., (Hq + 2 Hkv) D]: one matmul when fused."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """x: [T, in_features], cos / sin (signed, see apply_rope): [T, 1, head_dim] -> [T, hidden]."""
        cfg = self.cfg
        T, hq, hkv, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.project(x)  # [T, (Hq + 2 Hkv) D]
        # q and k side by side: one RoPE for both (a decode row's ops are its cost). Strided views.
        qk = qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d)  # [T, Hq + Hkv, D]
        v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)  # [T, Hkv, D]
        qk = backend.rope_write(qk, v, cos, sin, kv_cache, meta)  # RoPE'd [T, Hq + Hkv, D]; new K/V now in the cache
        out = backend(qk[:, :hq], qk[:, hq:], v, kv_cache, meta, d**-0.5, cfg.sliding_window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). gate_proj / up_proj as in HF checkpoints; the loaders
    fuse them into one gate_up_proj (fast/fusion.py), which `project` uses when it is there."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # gate and up in one matmul, once fused

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> gate and up side by side, [..., 2I]: one matmul when fused."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj(x)
        return torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)

    def forward(self, x: torch.Tensor, backend: AttentionBackend | None = None) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]; without a backend (training) in plain torch ops."""
        gate_up = self.project(x)  # [..., 2I]
        return self.down_proj(silu_mul_ref(gate_up) if backend is None else backend.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, meta, kv_cache, backend):
        """x: [T, hidden] the previous layer's MLP output (the embedding for the first layer);
        residual: [T, hidden] the residual stream before it (None for the first layer), updated in
        place. Returns (this layer's MLP output, residual): the stream after it is their sum."""
        norm = self.input_layernorm
        h, residual = backend.add_rmsnorm(x, residual, norm.weight, norm.eps)  # residual += x; h = norm(residual)
        x = self.self_attn(h, cos, sin, meta, kv_cache, backend)  # [T, hidden]
        norm = self.post_attention_layernorm
        h, residual = backend.add_rmsnorm(x, residual, norm.weight, norm.eps)
        return self.mlp(h, backend), residual


class Transformer(ModelFeatures, nn.Module):
    """The decoder. `forward(input_ids [T], meta, kv_caches) -> logits [N, vocab]`.
    (ModelFeatures: the marks optional rooms leave on a loaded model; the forward reads none.)"""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None):
        super().__init__()
        self.cfg = cfg
        self.backend = backend or AttentionBackend()
        embedding = torch.empty(cfg.vocab_size, cfg.hidden_size)  # [V, H]
        if not embedding.is_meta:  # (no init for the loaders' meta skeleton: as rope_inv_freq says)
            nn.init.normal_(embedding)  # nn.Embedding's own init
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # [D/2]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the embedding's; linear weights may be int8, see fast/int8.py)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [T] new tokens of all sequences, packed; kv_caches: per layer (k_pool, v_pool)
        or None for a cache-free prefill. Returns fp32 logits [N, vocab] for meta.logits_indices
        (all T rows when None).

        hidden_layers (a feature drafter's request): also return the residual stream entering
        each listed layer (HF's hidden_states[i]; i = num_layers is the last layer's output, before
        the final norm), for all T rows, concatenated in the order given: (logits, [T, len * hidden])."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None  # [T, hidden] the residual stream before x is added (module docstring)
        cos, sin = rope_tables(meta.positions, self.inv_freq, x.dtype)  # [T, 1, D] each
        taken = {}
        for i, layer in enumerate(self.layers):
            if hidden_layers is not None and i in hidden_layers:  # the stream entering layer i (a copy: layers add in place)
                taken[i] = x.clone() if residual is None else x + residual
            x, residual = layer(x, residual, cos, sin, meta, None if kv_caches is None else kv_caches[i], self.backend)
        if hidden_layers is not None and len(self.layers) in hidden_layers:  # the last layer's output, before the norm
            taken[len(self.layers)] = x + residual
        if meta.logits_indices is not None:  # the rows we sample from
            x, residual = x[meta.logits_indices], residual[meta.logits_indices]  # [N, hidden] each
        normed, _ = self.backend.add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)  # [N, hidden]
        logits = self.lm_head(normed).float()  # [N, vocab]
        if hidden_layers is None:
            return logits
        return logits, torch.cat([taken[i] for i in hidden_layers], dim=-1)  # [N, vocab], [T, len * hidden]
