"""A Llama-family decoder (Llama, Mistral, Qwen2) written for reading.

x -> [RMSNorm -> GQA attention with RoPE -> +x] -> [RMSNorm -> SwiGLU MLP -> +x] ... -> RMSNorm -> logits

The forward pass runs on a flat batch of T new tokens from B sequences (see `BatchMetadata`);
attention is the only place where sequences interact with their own past, and it goes through
`AttentionBackend`, so the paged KV cache and the Triton kernels plug in without touching this
file. Module names match Hugging Face's so a checkpoint's state dict loads as it is.
The draft model is this same class with a smaller config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend, BatchMetadata
from .config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op (the same math)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Linear):
    """y = x W^T + b, with W [out, in] as in nn.Linear (and HF checkpoints).

    For a few rows (2 <= M <= weight_major_rows) it computes (W x^T)^T instead: the same numbers
    in another order. Why: decoding feeds 1 row, a speculative verification k+1 rows, and on CPU
    PyTorch's default path for x W^T packs W for every call once M > 1, so the cost of a forward
    grows with M (fp32 on a Zen 3 CPU, whole SmolLM2 forward: 1.5x at M = 2, 1.8x at M = 3) even
    though every weight is read once either way. With W as the left operand the GEMM streams W
    once for all M rows: the same forward costs 0.9-1.2x of M = 1 for M = 2..9. M = 1 keeps the
    default (a matrix-vector product, already one pass over W); large M (prefill) too.
    `weight_major_rows` is 0 (off) unless the loader turns it on (fp32 on CPU, see build_model).
    """

    weight_major_rows: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 2 <= x.shape[0] <= self.weight_major_rows:
            y = (self.weight @ x.t()).t()  # [M, out] (a transposed view of [out, M])
            return (y if self.bias is None else y + self.bias).contiguous()
        return F.linear(x, self.weight, self.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last axis (the HF / GPT-NeoX RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = Linear(cfg.hidden_size, hq * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """x: [T, hidden], cos/sin: [T, 1, head_dim] -> [T, hidden]."""
        cfg = self.cfg
        T = x.shape[0]
        q = self.q_proj(x).view(T, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = backend(q, k, v, kv_cache, meta, cfg.head_dim**-0.5, cfg.sliding_window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, kv_cache, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder. `forward(input_ids [T], meta, kv_caches) -> logits [N, vocab]`."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None):
        super().__init__()
        self.cfg = cfg
        self.backend = backend or AttentionBackend()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # [D/2]

    def set_weight_major_rows(self, rows: int) -> None:
        """Compute linear layers fed 2..rows rows as (W x^T)^T (see `Linear`); 0 turns it off."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight_major_rows = rows

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """input_ids: [T] new tokens of all sequences, packed; kv_caches: per layer (k_pool, v_pool)
        or None for a cache-free prefill. Returns fp32 logits [N, vocab] for meta.logits_indices
        (all T rows when None)."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        freqs = meta.positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D], broadcast over heads
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, None if kv_caches is None else kv_caches[i], self.backend)
        if meta.logits_indices is not None:
            x = x[meta.logits_indices]  # [N, hidden]: only the rows we sample from
        return self.lm_head(self.norm(x)).float()  # [N, vocab]
