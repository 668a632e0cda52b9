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
faster CPU variants and int8 layers are swapped in after loading (minispec/fast/).
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


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear computing the given ones side by side: y = [y_1, y_2, ...] on the last axis."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device="meta")  # (no random init to overwrite)
    fused.weight = nn.Parameter(concat([p.weight.detach() for p in parts]))  # [sum(out), in]
    if first.bias is not None:
        fused.bias = nn.Parameter(concat([p.bias.detach() for p in parts]))
    return fused


def concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat on the first axis; for a loader's meta skeleton, an empty meta tensor of that
    shape (torch.cat on the meta device imports torch's compiler stack, about a second)."""
    if not tensors[0].is_meta:
        return torch.cat(tensors)
    return torch.empty(sum(t.shape[0] for t in tensors), *tensors[0].shape[1:], dtype=tensors[0].dtype, device="meta")


class Attention(nn.Module):
    """GQA attention; q/k/v read `in_features` (hidden_size unless given: the EAGLE layer's are 2x).
    q_proj / k_proj / v_proj as in HF checkpoints, or, after `fuse()`, one qkv_proj."""

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
        self.qkv_proj: nn.Linear | None = None
        self.qkv_sizes = [hq * d, hkv * d, hkv * d]

    def fuse(self) -> None:
        """q/k/v in one matmul (one weight [(Hq + 2 Hkv) D, in]) instead of three: on a CPU at one
        to a few rows each matmul call costs far more than its arithmetic."""
        if self.qkv_proj is None:
            self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., in] -> q [..., Hq D], k [..., Hkv D], v [..., Hkv D] (views of one output if fused)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)

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
        if self.qkv_proj is None:
            q, k, v = self.project(x)
            qk = torch.cat([q, k], dim=-1).view(T, hq + hkv, d)  # [T, Hq + Hkv, D]
        else:  # q and k sit side by side in the fused output: one RoPE for both (a decode row's ops are its cost)
            qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
            qk, v = qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d), qkv[:, (hq + hkv) * d :]  # (strided views)
        v = v.view(T, hkv, d)  # [T, Hkv, D]
        qk = backend.rope_write(qk, v, cos, sin, kv_cache, meta)  # RoPE'd [T, Hq + Hkv, D]; new K/V now in the cache
        out = backend(qk[:, :hq], qk[:, hq:], v, kv_cache, meta, d**-0.5, cfg.sliding_window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate_proj / up_proj, or one gate_up_proj after `fuse()`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        """gate and up in one matmul (weight [2 I, hidden]); see Attention.fuse."""
        if self.gate_up_proj is None:
            self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, backend: AttentionBackend | None = None) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]; without a backend (training) in plain torch ops."""
        if self.gate_up_proj is None:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [..., 2I]
        else:
            gate_up = self.gate_up_proj(x)  # [..., 2I]
        return self.down_proj(silu_mul_ref(gate_up) if backend is None else backend.silu_mul(gate_up))


def checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() under checkpoint (HF) names: fused projections split back into
    q_proj / k_proj / v_proj and gate_proj / up_proj."""
    state = {}
    for name, tensor in model.state_dict().items():
        owner_name, _, leaf = name.rpartition(".")  # "layers.0.self_attn.qkv_proj", "weight"
        parent_name, _, kind = owner_name.rpartition(".")
        prefix = parent_name + "." if parent_name else ""
        if kind == "qkv_proj":
            parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split(model.get_submodule(parent_name).qkv_sizes))
        elif kind == "gate_up_proj":
            parts = zip(("gate_proj", "up_proj"), tensor.chunk(2))
        else:
            state[name] = tensor
            continue
        for part, value in parts:
            state[f"{prefix}{part}.{leaf}"] = value
    return state


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every layer in `model` (in place; returns it). Loaders do this
    after loading a checkpoint under HF names; a fused model's state dict has the fused names."""
    for module in model.modules():
        if isinstance(module, (Attention, MLP)):
            module.fuse()
    return model


def fused_state(model: nn.Module, state: dict[str, torch.Tensor], convert) -> dict[str, torch.Tensor]:
    """The state dict of a fused `model` from a checkpoint's (HF names), emptying `state` as it
    goes: each tensor is popped, passed through `convert` (cast, copy, move) and q/k/v or gate/up
    concatenated, so the caller never holds a tensor twice. The inverse of checkpoint_state_dict."""
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out = {}
    for name, like in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        parent, _, kind = owner.rpartition(".")
        if kind in parts:  # written part by part into one tensor: no intermediate copies
            pieces = [state.pop(f"{parent}.{p}.{leaf}") for p in parts[kind]]
            first = convert(pieces[0][:0])
            fused = torch.empty((like.shape[0], *pieces[0].shape[1:]), dtype=first.dtype, device=first.device)
            row = 0
            for piece in pieces:
                fused[row : row + piece.shape[0]].copy_(piece)
                row += piece.shape[0]
            out[name] = fused
            del pieces
        elif name in state:
            out[name] = convert(state.pop(name))
    return out


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


class Transformer(nn.Module):
    """The decoder. `forward(input_ids [T], meta, kv_caches) -> logits [N, vocab]`."""

    quantization: str | None = None  # "int8" (fast/int8.py) or "int4" (a draft, fast/int4.py) once its layers are swapped
    cpu_matmul: str | None = None  # the CPU variant of nn.Linear in use (fast/cpu_linear.py)
    row_invariant: bool = False  # every row computed alike, whatever the batch (fast/row_invariant.py)
    vocab_ids: torch.Tensor | None = None  # a draft's reduced vocabulary: the target id of each logit column

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
