"""A Llama-family decoder (Llama, Mistral, Qwen2) and the one interface to its kernels.

x -> [RMSNorm -> GQA attention with RoPE -> +x] -> [RMSNorm -> SwiGLU MLP -> +x] ... -> RMSNorm -> logits

Read in this order: `BatchMetadata` (where the packed new tokens of a forward sit), then
`AttentionBackend` (the kernels), then the layers bottom up and `Transformer`.

The forward pass runs on a flat batch of T new tokens from B sequences, packed one after another
as paged attention needs them. Attention is the only place where a sequence meets its own past;
it goes through `AttentionBackend`, which writes the new K/V into the page pool (`kv_cache.py`)
and attends, with the Triton kernels of `minispec.kernels` (minispec/kernels/) or
their plain torch twins. Nothing is global: the metadata is passed into every forward.

The layers carry (x, residual) as vLLM does: a layer returns its MLP's output x apart from the
residual stream before it, and the next RMSNorm adds the two (`backend.add_rmsnorm`), so that on
the Triton backend the add and the norm are one kernel. The same for RoPE and the K/V write
(`backend.rope_write`) and SwiGLU's silu(gate) * up (`backend.silu_mul`); the torch backend runs
the same math as plain torch ops, bit for bit what `x = x + sublayer(norm(x))` computes.

Module names match Hugging Face's so a checkpoint's state dict loads as it is. A draft model is
this same class with a smaller config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minispec.kernels import add_rmsnorm, flash_prefill, paged_attention, rope_write, silu_mul
from minispec.kernels._checks import SUPPORTED_HEAD_DIMS

from .config import ModelConfig

# One layer's KV pools (k_pool, v_pool), each [num_pages, page_size, Hkv, D].
KVLayer = tuple[torch.Tensor, torch.Tensor]


@dataclass
class BatchMetadata:
    """Where the T packed new tokens of B sequences sit.

    positions:       [T] int64, position of each new token in its sequence
    query_start_loc: [B+1] int32, sequence b's new tokens are rows
                     query_start_loc[b]:query_start_loc[b+1]
    seq_lens:        [B] int32, context length of each sequence INCLUDING its new tokens
    max_query_len, max_seq_len: host ints (launch sizes; no device sync needed)
    slot_mapping:    [T] int64, pool slot (page * page_size + offset) for each new token's K/V, or None
    block_tables:    [B, max_pages] int32 page ids, or None when there is no KV cache
    logits_indices:  [N] int64 rows whose logits are wanted (None: all T rows)
    is_prefill:      True when every sequence starts at position 0 (no cached context), so
                     attention can run on the contiguous new K/V alone
    """

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    is_prefill: bool = False


class AttentionBackend:
    """Writes new K/V into the page pool and attends, and runs the layer's fused glue, with the
    Triton kernels ("triton") or their plain torch twins ("torch", the `*_ref` functions).

    The name: `name`, else the MINISPEC_BACKEND environment variable, else "triton" on CUDA and
    "torch" elsewhere (tests run the Triton kernels on a CPU under TRITON_INTERPRET=1). A subclass
    may accept more `names`; every name but "triton" starts from the torch twins."""

    names: tuple[str, ...] = ("triton", "torch")

    def __init__(self, name: str | None = None):
        default = "triton" if torch.cuda.is_available() else "torch"
        name = name or os.environ.get("MINISPEC_BACKEND") or default
        if name not in self.names:
            *others, last = self.names
            choices = f"{', '.join(map(repr, others))} or {last!r}"
            raise ValueError(f"unknown attention backend {name!r} (use {choices})")
        self.name = name
        if name == "triton":
            self._prefill, self._paged = flash_prefill.flash_prefill, paged_attention.paged_attention
            self._add_rmsnorm, self._rope_write = add_rmsnorm.add_rmsnorm, rope_write.rope_write
            self._silu_mul = silu_mul.silu_mul
        else:
            self._prefill = flash_prefill.flash_prefill_ref
            self._paged = paged_attention.paged_attention_ref
            self._add_rmsnorm, self._rope_write = add_rmsnorm.add_rmsnorm_ref, rope_write.rope_write_ref
            self._silu_mul = silu_mul.silu_mul_ref

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, H]. residual <- x + residual IN PLACE, returns (rmsnorm(residual) *
        weight, residual); with residual None, (rmsnorm(x) * weight, x). kernels/add_rmsnorm.py."""
        return self._add_rmsnorm(x, residual, weight, eps)

    def rope_write(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: KVLayer | None, meta: BatchMetadata) -> torch.Tensor:
        """qk: [T, Hq + Hkv, D] the query then key heads, v: [T, Hkv, D], cos / sin (signed):
        [T, 1, D]. Returns RoPE(qk), a new [T, Hq + Hkv, D], after writing its key heads and v
        into this layer's pools at meta.slot_mapping (if there is a cache). kernels/rope_write.py."""
        k_pool, v_pool = (None, None) if kv_cache is None else kv_cache
        slots = None if kv_cache is None else meta.slot_mapping
        return self._rope_write(qk, v, cos, sin, k_pool, v_pool, slots, validate=False)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> silu(gate) * up [T, I]. kernels/silu_mul.py."""
        return self._silu_mul(gate_up)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVLayer | None,
                 meta: BatchMetadata, sm_scale: float, sliding_window: int | None) -> torch.Tensor:
        """q: [T, Hq, D], k, v: [T, Hkv, D], already written into kv_cache by `rope_write`;
        kv_cache: this layer's (k_pool, v_pool), each [num_pages, page_size, Hkv, D], or None.
        Returns [T, Hq, D]."""
        # The runner builds the metadata, so the kernels' value checks (which read device
        # tensors) are skipped here; shape and dtype checks still run on every call.
        if kv_cache is None and not meta.is_prefill:
            raise ValueError("a forward with cached context needs a KV cache")
        if meta.is_prefill:  # no earlier context: attend over the contiguous new K/V
            return self._prefill(q, k, v, meta.query_start_loc, meta.max_query_len,
                                 sm_scale=sm_scale, sliding_window=sliding_window, validate=False)
        return self.paged(q, kv_cache, meta, sm_scale, sliding_window)

    def paged(self, q: torch.Tensor, kv_cache: KVLayer, meta: BatchMetadata, sm_scale: float,
              sliding_window: int | None, **options) -> torch.Tensor:
        """Attention over the page pool (kernels/paged_attention.py): each query row sees its own
        sequence's keys up to its position. `options` go to the kernel as keyword arguments."""
        k_pool, v_pool = kv_cache
        return self._paged(q, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                           meta.max_query_len, meta.max_seq_len, sm_scale=sm_scale,
                           sliding_window=sliding_window, validate=False, **options)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in fp32; in bf16 / fp16 rounded to the
    dtype before the weight multiplies it (HF's order; `rmsnorm_ref` in kernels/add_rmsnorm.py).
    A decoder layer calls `backend.add_rmsnorm` with this module's weight and eps instead."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rmsnorm.rmsnorm_ref(x, self.weight, self.eps)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin_signed at `positions` [...] -> two [..., 1, D] tensors (the 1 broadcasts over
    heads): angle_i = position * inv_freq_i, repeated over both halves of D. RoPE is then
    x * cos + roll(x, D/2) * sin_signed (`apply_rope` in kernels/rope_write.py says why)."""
    freqs = positions.float()[..., None] * inv_freq  # [..., D/2]
    cos = torch.cat((freqs, freqs), dim=-1).cos()[..., None, :].to(dtype)  # [..., 1, D]
    sin = freqs.sin()
    return cos, torch.cat((-sin, sin), dim=-1)[..., None, :].to(dtype)  # [..., 1, D]


class Attention(nn.Module):
    """GQA attention; q/k/v read `input_size` columns (hidden_size unless given). q_proj / k_proj /
    v_proj as in HF checkpoints; a loader may stack them into one `qkv_proj` (one matmul instead
    of three, the same columns), which `project` uses when it is there."""

    def __init__(self, cfg: ModelConfig, input_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if d not in SUPPORTED_HEAD_DIMS:  # refused at load, not at the first forward
            raise ValueError(f"head_dim {d} is not supported by the attention kernels "
                             f"(supported: {SUPPORTED_HEAD_DIMS})")
        width = input_size or cfg.hidden_size
        self.q_proj = nn.Linear(width, hq * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(width, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(width, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_proj: nn.Linear | None = None  # q, k, v in one matmul, once stacked
        self.qkv_sizes = [hq * d, hkv * d, hkv * d]  # widths of q, k, v in `project`'s output

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> q, k and v side by side, [..., (Hq + 2 Hkv) D]: one matmul when stacked."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata,
                kv_cache: KVLayer | None, backend: AttentionBackend) -> torch.Tensor:
        """x: [T, input_size], cos / sin (signed, see rope_tables): [T, 1, head_dim] -> [T, hidden]."""
        cfg = self.cfg
        T, hq, hkv, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.project(x)  # [T, (Hq + 2 Hkv) D]
        # q and k side by side: one RoPE for both (a decode row's ops are its cost). Strided views.
        qk = qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d)  # [T, Hq + Hkv, D]
        v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)  # [T, Hkv, D]
        # RoPE'd [T, Hq + Hkv, D]; the new K/V are now in the cache
        qk = backend.rope_write(qk, v, cos, sin, kv_cache, meta)
        out = backend(qk[:, :hq], qk[:, hq:], v, kv_cache, meta, d**-0.5, cfg.sliding_window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, hq * d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). gate_proj / up_proj as in HF checkpoints; a loader may
    stack them into one `gate_up_proj`, which `project` uses when it is there."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # gate and up in one matmul, once stacked

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> gate and up side by side, [..., 2I]: one matmul when stacked."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj(x)
        return torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)

    def forward(self, x: torch.Tensor, backend: AttentionBackend | None = None) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]; without a backend (training) in plain torch ops."""
        gate_up = self.project(x)  # [..., 2I]
        hidden = silu_mul.silu_mul_ref(gate_up) if backend is None else backend.silu_mul(gate_up)  # [..., I]
        return self.down_proj(hidden)


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
        # residual += x; h = norm(residual)
        h, residual = backend.add_rmsnorm(x, residual, norm.weight, norm.eps)
        x = self.self_attn(h, cos, sin, meta, kv_cache, backend)  # [T, hidden]
        norm = self.post_attention_layernorm
        h, residual = backend.add_rmsnorm(x, residual, norm.weight, norm.eps)
        return self.mlp(h, backend), residual


# Called with (i, x, residual) before layer i, and with i = num_layers after the last layer.
LayerVisitor = Callable[[int, torch.Tensor, torch.Tensor | None], None]


class Transformer(nn.Module):
    """The decoder. `forward(input_ids [T], meta, kv_caches) -> logits [N, vocab]`."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None):
        super().__init__()
        self.cfg = cfg
        self.backend = backend or AttentionBackend()
        embedding = torch.empty(cfg.vocab_size, cfg.hidden_size)  # [V, H]
        if not embedding.is_meta:  # (no init for a loader's meta skeleton: see rope_inv_freq)
            nn.init.normal_(embedding)  # nn.Embedding's own init
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)  # [D/2]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the embedding's: the linear layers may store their weights otherwise)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata,
                kv_caches: list[KVLayer] | None = None) -> torch.Tensor:
        """input_ids: [T] new tokens of all sequences, packed; kv_caches: per layer (k_pool, v_pool)
        or None for a cache-free prefill. Returns fp32 logits [N, vocab] for meta.logits_indices
        (all T rows when None)."""
        x, residual = self.run_layers(input_ids, meta, kv_caches)
        return self.logits(x, residual, meta)

    def run_layers(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_caches: list[KVLayer] | None,
                   visit: LayerVisitor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding and every layer: returns the last layer's (x, residual), each [T, hidden].
        `visit` (if given) sees the residual stream as x + residual (x alone before the first
        layer) entering each layer and leaving the last: what an extension may read."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None  # [T, hidden] the residual stream before x is added (module docstring)
        cos, sin = rope_tables(meta.positions, self.inv_freq, x.dtype)  # [T, 1, D] each
        for i, layer in enumerate(self.layers):
            if visit is not None:
                visit(i, x, residual)
            kv_cache = None if kv_caches is None else kv_caches[i]
            x, residual = layer(x, residual, cos, sin, meta, kv_cache, self.backend)
        if visit is not None:
            visit(len(self.layers), x, residual)
        return x, residual

    def logits(self, x: torch.Tensor, residual: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """The final norm of x + residual ([T, hidden] each) at meta.logits_indices, then the LM
        head: fp32 logits [N, vocab]."""
        if meta.logits_indices is not None:  # the rows we sample from
            x, residual = x[meta.logits_indices], residual[meta.logits_indices]  # [N, hidden] each
        normed, _ = self.backend.add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)  # [N, hidden]
        return self.lm_head(normed).float()  # [N, vocab]
