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
        if x.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32, round to the model's dtype, then scale (HF's order for bf16/fp16).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Linear(nn.Linear):
    """y = x W^T + b, with W [out, in] as in nn.Linear (and HF checkpoints).

    Two CPU entry points, both the same math, chosen by the number of rows M (the loader turns
    them on where they were measured to help; see `set_cpu_matmul`):
    * 1 <= M <= weight_major_rows (fp32): `weight_major`, the product with W as the left operand,
      its rows split into one block per thread. Decoding feeds 1 row, a speculative verification
      k+1 rows. Measured on a 2-core Zen 3 CPU, whole SmolLM2 forward: PyTorch's default path runs
      1 row as a single-threaded matrix-vector product, and for 2..16 rows packs W on every call,
      so the cost grew with M (1.5x at M = 2, 1.8x at M = 3); W-major blocks use both cores for
      one row (the matmuls 1.6x faster) and stream W once for a few rows (0.9-1.2x of M = 1's old
      cost for M = 2..9).
    * M > upcast_rows (bf16 / fp16 on a CPU without native bf16 matmuls): compute in fp32 from an
      fp32 copy of W made per call. Emulated bf16 GEMMs are slow for many rows (a 60-token
      prefill of SmolLM2: 1.8 s in bf16, 0.6 s in fp32), while the copy costs one pass over W.
    """

    weight_major_rows: int = 0  # 0: off
    upcast_rows: int = 0  # 0: off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            rows = x.shape[0]
            if 1 <= rows <= self.weight_major_rows:
                return weight_major(x, self.weight, self.bias)
            if 0 < self.upcast_rows < rows:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def weight_major(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ weight [out, in]^T (+ bias) computed as weight @ x^T, with weight's rows split
    into P = torch.get_num_threads() blocks that one batched matmul runs in parallel:
    [P, out/P, in] @ [P, in, M] -> [P, out/P, M] -> [M, out]. Falls back to one block when P does
    not divide out (and to F.linear for one row, whose single block is a matrix-vector product)."""
    out_features, in_features = weight.shape
    rows, parts = x.shape[0], torch.get_num_threads()
    if parts > 1 and out_features % parts == 0:
        blocks = weight.view(parts, out_features // parts, in_features)  # [P, out/P, in]
        y = torch.bmm(blocks, x.t().expand(parts, in_features, rows)).view(out_features, rows).t()  # [M, out]
    elif rows > 1:
        y = (weight @ x.t()).t()  # [M, out] (a transposed view of [out, M])
    else:
        return F.linear(x, weight, bias)
    return (y if bias is None else y + bias).contiguous()


def set_cpu_matmul(model: nn.Module, weight_major_rows: int = 0, upcast_rows: int = 0) -> None:
    """In `model`, Linear layers fed 1..weight_major_rows rows compute W-major (`weight_major`);
    those fed more than upcast_rows rows compute in fp32 (see `Linear`). 0 turns either off."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight_major_rows, module.upcast_rows = weight_major_rows, upcast_rows


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
    x: [T, H, D]; cos, sin_signed: [T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    """GQA attention; q/k/v read `in_features` (hidden_size unless given: the EAGLE layer's are 2x)."""

    def __init__(self, cfg: ModelConfig, in_features: int | None = None):
        super().__init__()
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        width = in_features or cfg.hidden_size
        self.q_proj = Linear(width, hq * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(width, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(width, hkv * d, bias=cfg.qkv_bias)
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
        """x: [T, in_features], cos / sin (signed, see apply_rope): [T, 1, head_dim] -> [T, hidden]."""
        cfg = self.cfg
        T = x.shape[0]
        q = self.q_proj(x).view(T, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
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

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the embedding's; linear weights may be int8, see quant.py)."""
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
        cos, sin = rope_tables(meta.positions, self.inv_freq, x.dtype)  # [T, 1, D] each
        taken = {}
        for i, layer in enumerate(self.layers):
            if hidden_layers is not None and i in hidden_layers:
                taken[i] = x
            x = layer(x, cos, sin, meta, None if kv_caches is None else kv_caches[i], self.backend)
        taken[len(self.layers)] = x
        out = x if meta.logits_indices is None else x[meta.logits_indices]  # [N, hidden]: the rows we sample from
        logits = self.lm_head(self.norm(out)).float()  # [N, vocab]
        if hidden_layers is None:
            return logits
        return logits, torch.cat([taken[i] for i in hidden_layers], dim=-1)  # [N, vocab], [T, len * hidden]
