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

    Three CPU entry points besides F.linear, all the same math. Which one helps depends on the
    CPU, so the loader times the first two against F.linear on the model's own weights and keeps
    the fastest (loader.use_cpu_fast_paths); the third is on wherever bf16 is emulated:
    * prepacked (bf16 on a CPU with native bf16 matmuls): oneDNN's blocked copy of W, made once
      (`packed_weight`) instead of on every call. Measured on a 2-core Xeon with AVX512-BF16 and
      AMX, whole SmolLM2 forward: decode 28-29 vs 36 ms, a 5-row verification 30-31 vs 39 ms.
      The copy doubles the memory of the linear weights; inference only (no backward: with
      gradients wanted, F.linear runs).
    * 1 <= M <= weight_major_rows (fp32): `weight_major`, the product with W as the left operand,
      its rows split into one block per thread. Decoding feeds 1 row, a speculative verification
      k+1 rows. Measured on a 2-core Zen 3 CPU, whole SmolLM2 forward: PyTorch's default path runs
      1 row as a single-threaded matrix-vector product, and for 2..16 rows packs W on every call,
      so the cost grew with M (1.5x at M = 2, 1.8x at M = 3); W-major blocks use both cores for
      one row (the matmuls 1.6x faster) and stream W once for a few rows (0.9-1.2x of M = 1's old
      cost for M = 2..9). On the Xeon above it is the other way round: W-major made a decode
      2.2x SLOWER (74 vs 34 ms), as F.linear there already uses both cores well.
    * M > upcast_rows (bf16 / fp16 on a CPU without native bf16 matmuls): compute in fp32 from an
      fp32 copy of W made per call. Emulated bf16 GEMMs are slow for many rows (a 60-token
      prefill of SmolLM2: 1.8 s in bf16, 0.6 s in fp32), while the copy costs one pass over W.
    """

    weight_major_rows: int = 0  # 0: off
    upcast_rows: int = 0  # 0: off
    prepacked: bool = False
    _packed: tuple | None = None  # (the weight it was made from, (its version, data_ptr, dtype), oneDNN's copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked and x.device.type == "cpu" and x.dtype == self.weight.dtype and not (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):  # oneDNN's op has no backward
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, "none", [], "")
        if x.dim() == 2:
            rows = x.shape[0]
            if 1 <= rows <= self.weight_major_rows:
                return weight_major(x, self.weight, self.bias)
            if 0 < self.upcast_rows < rows:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight out (an opaque tensor; remade on first use)."""
        state = dict(super().__getstate__())  # a copy: the live module keeps its packed weight
        state["_packed"] = None
        return state

    def _apply(self, fn, recurse=True):
        """Moved or cast (`.to`, `.float()`: W's data is swapped in place): the packed copy is dropped."""
        self._packed = None
        return super()._apply(fn, recurse)

    def packed_weight(self) -> torch.Tensor:
        """oneDNN's blocked (opaque, `torch._mkldnn` layout) copy of W [out, in], made on first use
        and made again whenever W is replaced, moved, cast or changed in place through autograd-
        visible ops (its version counter moves). Writes through `weight.data` bypass the version
        counter: after one, call `set_cpu_matmul` again (it drops the copy)."""
        weight = self.weight
        key = (weight._version, weight.data_ptr(), weight.dtype)
        if self._packed is None or self._packed[0] is not weight or self._packed[1] != key:
            self._packed = (weight, key, pack_weight(weight))
        return self._packed[2]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] -> oneDNN's blocked copy for `torch.ops.mkldnn._linear_pointwise` (any row count)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


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


def set_cpu_matmul(model: nn.Module, weight_major_rows: int = 0, upcast_rows: int = 0, prepacked: bool = False,
                   keep_packed: bool = False) -> None:
    """In `model`, Linear layers fed 1..weight_major_rows rows compute W-major (`weight_major`);
    those fed more than upcast_rows rows compute in fp32; with prepacked, every call uses oneDNN's
    packed copy of W (see `Linear`). 0 / False turns each off. Packed copies are dropped (made
    again on first use) unless keep_packed (the loader's timing switches back and forth)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight_major_rows, module.upcast_rows, module.prepacked = weight_major_rows, upcast_rows, prepacked
            if not keep_packed:
                module._packed = None


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


def fused_linear(parts: list[Linear]) -> Linear:
    """One Linear computing the given ones side by side: y = [y_1, y_2, ...] on the last axis."""
    first = parts[0]
    fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                   device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))  # [sum(out), in]
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    fused.weight_major_rows, fused.upcast_rows, fused.prepacked = first.weight_major_rows, first.upcast_rows, first.prepacked
    return fused


class Attention(nn.Module):
    """GQA attention; q/k/v read `in_features` (hidden_size unless given: the EAGLE layer's are 2x).
    q_proj / k_proj / v_proj as in HF checkpoints, or, after `fuse()`, one qkv_proj."""

    def __init__(self, cfg: ModelConfig, in_features: int | None = None):
        super().__init__()
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        width = in_features or cfg.hidden_size
        self.q_proj = Linear(width, hq * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(width, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(width, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_proj: Linear | None = None
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
        T = x.shape[0]
        q, k, v = self.project(x)
        q = q.view(T, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim).contiguous()  # [T, Hkv, D] (a strided view when fused)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = backend(q, k, v, kv_cache, meta, cfg.head_dim**-0.5, cfg.sliding_window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate_proj / up_proj, or one gate_up_proj after `fuse()`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        """gate and up in one matmul (weight [2 I, hidden]); see Attention.fuse."""
        if self.gate_up_proj is None:
            self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


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
