"""The feature drafter: EAGLE-3 (Li et al. 2025, arXiv 2503.01840), one decoder layer that reads
the target's own hidden states and proposes tokens from a reduced vocabulary.

The draft model. Draft position p holds K/V at position p (RoPE position p). It reads a feature
f_p and the next token x_{p+1}, and predicts x_{p+2}:

    f_p   = fc(concat(h_p[l_1], h_p[l_2], h_p[l_3]))  target features: the residual stream entering
                                                     target layers l = (2, L//2, L-3), [3H] -> [H]
          | g_{p-1}                                  or the draft's own previous output (chained steps)
    a     = concat(input_layernorm(embed(x_{p+1})), hidden_norm(f_p))   [2H]; embed is the TARGET's
    r     = f_p + o_proj(attention(q/k/v_proj(a)))                       (r starts from hidden_norm(f_p)
    g_p   = r + mlp(post_attention_layernorm(r))                          with norm_before_residual)
    logits_p = lm_head(norm(g_p))                                        [V_d], draft vocabulary

Draft id i is target id i + d2t[i]; t2d marks the target ids the draft can propose.

Checkpoints: see io/eagle_checkpoint.py; drafting: drafters/eagle.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig
from .features import ModelFeatures
from .llama import MLP, Attention, RMSNorm, Transformer, rope_tables
from .metadata import BatchMetadata


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 reads by default: 2, L//2, L-3 (HF hidden_states indices)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class EagleConfig:
    """layer: the decoder layer's shapes, eps and RoPE (num_layers = 1, hidden_size = the target's);
    aux_layers: the target layers whose input residual stream is read (in this order)."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False

    @classmethod
    def from_hf(cls, hf: dict, target: ModelConfig, where: str = "the EAGLE checkpoint") -> "EagleConfig":
        """Parse an EAGLE-3 config.json and check it against the target's config; every mismatch
        is a ValueError naming both sides."""
        hf = {**hf, "architectures": ["LlamaForCausalLM"]}  # a Llama layer, whatever the name says
        layer = ModelConfig.from_hf(hf)
        if layer.num_layers != 1:
            raise ValueError(f"{where} has num_hidden_layers {layer.num_layers}; an EAGLE-3 draft has 1")
        if layer.hidden_size != target.hidden_size:
            raise ValueError(f"{where} has hidden_size {layer.hidden_size} but the target's is {target.hidden_size} "
                             "(the draft reads the target's embedding: they must be equal)")
        target_hidden = int(hf.get("target_hidden_size") or layer.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"{where} was trained on a target with hidden size {target_hidden}; "
                             f"this target's is {target.hidden_size}")
        if layer.vocab_size != target.vocab_size:
            raise ValueError(f"{where} has vocab_size {layer.vocab_size} but the target's is {target.vocab_size}")
        draft_vocab = hf.get("draft_vocab_size")
        draft_vocab = layer.vocab_size if draft_vocab is None else draft_vocab
        if not (isinstance(draft_vocab, int) and not isinstance(draft_vocab, bool) and 0 < draft_vocab <= target.vocab_size):
            raise ValueError(f"{where} has draft_vocab_size {draft_vocab}; need 1..{target.vocab_size} (the target's vocab)")
        L = target.num_layers
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) for i in ids) if ids is not None else default_aux_layers(L)
        if len(aux) != 3 or not all(0 <= i <= L for i in aux):
            raise ValueError(f"{where} reads target layers {list(aux)}; the target has {L} layers "
                             f"(3 ids in 0..{L} needed)")
        layer = replace(layer, eos_token_ids=list(target.eos_token_ids))
        return cls(layer, draft_vocab, target_hidden, aux, bool(hf.get("norm_before_residual", False)))


class EagleLayer(nn.Module):
    """The one decoder layer: attention over concat(embedding, feature), then a SwiGLU MLP."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        c = cfg.layer
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, input_size=2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, feature, cos, sin, meta, kv_cache, backend):
        """embeds, feature: [T, H] -> g [T, H]."""
        normed = self.hidden_norm(feature)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        residual = normed if self.norm_before_residual else feature
        attn_out = self.self_attn(x, cos, sin, meta, kv_cache, backend)  # [T, H]
        # r = residual + attn_out, written into attn_out (feature may be the caller's tensor): the
        # add is fused into the norm after it, as in the target's layers.
        norm = self.post_attention_layernorm
        h, r = backend.add_rmsnorm(residual, attn_out, norm.weight, norm.eps)
        return r + self.mlp(h, backend)


class EagleModel(ModelFeatures, nn.Module):
    """`forward(input_ids [T], meta, kv_caches, hidden, project) -> (logits [N, V_d], g [N, H])`.

    hidden: [T, 3H] target features (project=True: through fc) or [T, H] draft outputs.
    The target's embedding is held as a non-persistent buffer: shared, never saved.
    (ModelFeatures: the marks optional rooms leave on a loaded model, as on the Transformer.)"""

    def __init__(self, cfg: EagleConfig, embedding: torch.Tensor, backend: AttentionBackend | None = None):
        super().__init__()
        self.config = cfg
        self.cfg = cfg.layer  # what the runner and the KV cache read (num_layers 1, heads, max positions)
        self.backend = backend or AttentionBackend()
        H = cfg.layer.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, H, bias=False)
        self.midlayer = EagleLayer(cfg)
        self.norm = RMSNorm(H, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [V_d]
        self.register_buffer("t2d", torch.ones(cfg.layer.vocab_size, dtype=torch.bool))  # [V]
        self.register_buffer("embed_weight", embedding, persistent=False)  # [V, H], the target's
        self.register_buffer("inv_freq", cfg.layer.rope_inv_freq(), persistent=False)  # [D/2]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the shared embedding; linear weights may be int8, see fast/int8.py)."""
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (i + d2t[i])."""
        return ids + self.d2t[ids]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        hidden: torch.Tensor,
        project: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = nn.functional.embedding(input_ids, self.embed_weight)  # [T, H]
        feature = self.fc(hidden.to(embeds.dtype)) if project else hidden.to(embeds.dtype)  # [T, H]
        cos, sin = rope_tables(meta.positions, self.inv_freq, embeds.dtype)  # [T, 1, D]
        g = self.midlayer(embeds, feature, cos, sin, meta, None if kv_caches is None else kv_caches[0], self.backend)
        if meta.logits_indices is not None:
            g = g[meta.logits_indices]  # [N, H]
        return self.lm_head(self.norm(g)).float(), g  # [N, V_d], [N, H]


def init_eagle(target: Transformer, draft_ids: torch.Tensor, aux_layers: tuple[int, ...] | None = None,
               intermediate_size: int | None = None, seed: int = 0, norm_before_residual: bool = False) -> EagleModel:
    """A randomly initialised EAGLE-3 head for `target` (fp32, on the target's device) whose draft
    vocabulary is `draft_ids` (distinct target ids, sorted here). The layer has the target's
    attention shapes, RoPE and eps; the embedding is the target's."""
    t = target.cfg
    ids = torch.as_tensor(draft_ids, dtype=torch.int64).unique()  # [V_d] sorted
    layer = replace(t, num_layers=1, intermediate_size=intermediate_size or t.intermediate_size,
                    tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None)
    cfg = EagleConfig(layer, len(ids), t.hidden_size, tuple(aux_layers or default_aux_layers(t.num_layers)),
                      norm_before_residual)
    torch.manual_seed(seed)
    model = EagleModel(cfg, target.embed_tokens.weight.detach().float(), target.backend)
    model.d2t.copy_(ids - torch.arange(len(ids)))
    model.t2d.zero_()
    model.t2d[ids] = True
    return model.to(target.device).eval()
