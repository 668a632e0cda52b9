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

One round for a sequence x_0 .. x_{n-1} (the target has cached positions < n-1 and handed over
their features after its last verification; the draft has cached positions < c):
  1. catch-up: one forward over positions c .. n-2 with the REAL target features h_c .. h_{n-2}
     and tokens x_{c+1} .. x_{n-1}. Its last row proposes d_1. This rewrites the K/V that the
     previous round's chained steps computed from the draft's own (approximate) features, so a
     proposal depends only on the accepted prefix, never on which drafts were rejected.
  2. chained steps j = 2..k: position n+j-3 reads (g of the previous row, d_{j-1}), proposes d_j.
  3. rollback (after the target's verification): the draft forgets positions >= n-1; the next
     catch-up starts there.
A new sequence drafts nothing in its first step: the target's prefill emits its first token and
hands over the features of every prompt position, so the first catch-up runs over the whole
prompt (a preempted one, recomputed, gets its features first and drafts at once: speculative.py).
The draft proposes from q = warp(logits scattered into a full-vocabulary row of -inf), the same
temperature / top-k / top-p warp as the target's p, so q(x) = 0 outside the draft vocabulary and
speculative sampling stays exact (speculative.py).

Checkpoints: the official EAGLE-3 layout (config.json: a Llama config with num_hidden_layers 1,
draft_vocab_size, optional target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids,
norm_before_residual; tensors fc, midlayer.*, norm, lm_head, d2t, t2d). The embedding is the
target's, shared (a checkpoint's own embed_tokens.weight, if present, is used instead).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .attention import AttentionBackend, BatchMetadata
from .config import ModelConfig, rope_inv_freq
from .drafters import drop_nonfinite, to_host
from .loader import check_tensors, read_safetensors, resolve_dtype, use_cpu_fast_paths
from .model import (
    MLP,
    Attention,
    Linear,
    RMSNorm,
    Transformer,
    checkpoint_state_dict,
    fuse_projections,
    rope_tables,
)
from .runner import Feed, ModelRunner
from .sampling import sample, warp_probs
from .sequence import Sequence


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
        draft_vocab = int(hf.get("draft_vocab_size") or layer.vocab_size)
        if not 0 < draft_vocab <= target.vocab_size:
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
        self.self_attn = Attention(c, in_features=2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, feature, cos, sin, meta, kv_cache, backend):
        """embeds, feature: [T, H] -> g [T, H]."""
        normed = self.hidden_norm(feature)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        residual = normed if self.norm_before_residual else feature
        r = residual + self.self_attn(x, cos, sin, meta, kv_cache, backend)
        return r + self.mlp(self.post_attention_layernorm(r))


class EagleModel(nn.Module):
    """`forward(input_ids [T], meta, kv_caches, hidden, project) -> (logits [N, V_d], g [N, H])`.

    hidden: [T, 3H] target features (project=True: through fc) or [T, H] draft outputs.
    The target's embedding is held as a non-persistent buffer: shared, never saved."""

    def __init__(self, cfg: EagleConfig, embedding: torch.Tensor, backend: AttentionBackend | None = None):
        super().__init__()
        self.config = cfg
        self.cfg = cfg.layer  # what the runner and the KV cache read (num_layers 1, heads, max positions)
        self.backend = backend or AttentionBackend()
        H = cfg.layer.hidden_size
        self.fc = Linear(len(cfg.aux_layers) * cfg.target_hidden_size, H, bias=False)
        self.midlayer = EagleLayer(cfg)
        self.norm = RMSNorm(H, cfg.layer.rms_norm_eps)
        self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [V_d]
        self.register_buffer("t2d", torch.ones(cfg.layer.vocab_size, dtype=torch.bool))  # [V]
        self.register_buffer("embed_weight", embedding, persistent=False)  # [V, H], the target's
        self.register_buffer("inv_freq", rope_inv_freq(cfg.layer), persistent=False)  # [D/2]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the shared embedding; linear weights may be int8, see quant.py)."""
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


def is_eagle_checkpoint(path: str | Path) -> bool:
    """A directory whose config.json names a draft vocabulary or an Eagle architecture."""
    if not isinstance(path, (str, Path)):
        return False
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    hf = json.loads(config.read_text())
    return "draft_vocab_size" in hf or any("eagle" in a.lower() for a in hf.get("architectures") or [])


def build_eagle(cfg: EagleConfig, state: dict[str, torch.Tensor], target: Transformer,
                dtype: torch.dtype | None = None, where: str = "the EAGLE checkpoint") -> EagleModel:
    """An EagleModel on the target's device from a state dict in the official layout."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    device = target.device
    dtype = dtype or target.dtype
    embedding = state.pop("embed_tokens.weight", None)
    if embedding is None:
        embedding = target.embed_tokens.weight.detach()
    elif tuple(embedding.shape) != tuple(target.embed_tokens.weight.shape):
        raise ValueError(f"{where}'s embed_tokens.weight has shape {tuple(embedding.shape)}, the target's "
                         f"{tuple(target.embed_tokens.weight.shape)}")
    V_d, V = cfg.draft_vocab_size, cfg.layer.vocab_size
    if "d2t" not in state:
        if V_d != V:
            raise ValueError(f"{where} has a draft vocabulary of {V_d} of the target's {V} tokens but no d2t map")
        state["d2t"], state["t2d"] = torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
    with torch.device("meta"):
        model = EagleModel(cfg, torch.empty(0), target.backend)
    check_tensors({k: v.shape for k, v in model.state_dict().items()}, state, where,
                  "the EAGLE-3 layout (fc, midlayer.*, norm, lm_head, d2t, t2d) for this config and target")
    d2t, t2d = state["d2t"].long(), state["t2d"].bool()
    ids = torch.arange(V_d) + d2t  # [V_d] target ids
    if ids.min() < 0 or ids.max() >= V or ids.unique().numel() != V_d:
        raise ValueError(f"{where}: d2t must map the {V_d} draft ids to distinct ids of the target's vocabulary of {V}")
    mask = torch.zeros(V, dtype=torch.bool)
    mask[ids] = True
    if not torch.equal(mask, t2d):
        raise ValueError(f"{where}: t2d does not mark exactly the {V_d} target ids that d2t maps to")
    state["d2t"], state["t2d"] = d2t, t2d
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    model = model.to(dtype)  # floating tensors only; d2t / t2d keep their types
    model.embed_weight = embedding.to(device=device, dtype=dtype)
    model.inv_freq = rope_inv_freq(cfg.layer).to(device)
    fuse_projections(model)
    use_cpu_fast_paths(model, dtype, device, prefer=getattr(target, "cpu_matmul", None))
    return model.eval()


def load_eagle(path: str | Path, target: Transformer, dtype: str | torch.dtype | None = None) -> EagleModel:
    """Load an EAGLE-3 checkpoint directory for `target` (same device; the target's dtype unless given)."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"EAGLE checkpoint {path} has no config.json")
    where = f"EAGLE checkpoint {path}"
    cfg = EagleConfig.from_hf(json.loads(config.read_text()), target.cfg, where)
    dtype = target.dtype if dtype in (None, "auto") else resolve_dtype(dtype, cfg.layer, target.device)
    return build_eagle(cfg, read_safetensors(path), target, dtype, where)


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


def hf_config(cfg: EagleConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json of the official EAGLE-3 layout (what `EagleConfig.from_hf` reads)."""
    c = cfg.layer
    out = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)},
        "norm_before_residual": cfg.norm_before_residual,
    }
    if c.rope_scaling is not None:
        out["rope_scaling"] = dict(c.rope_scaling)
    return out


def save_eagle(model: EagleModel, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors (floating tensors in `dtype`; no embedding)."""
    from safetensors.torch import save_file

    if getattr(model, "quantization", None) is not None:
        raise ValueError("save_eagle writes the full-precision layout; this head is quantized (int8 buffers)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in checkpoint_state_dict(model).items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(model.config, dtype), indent=2) + "\n")


@dataclass
class PendingFeatures:
    """Target features the draft has not consumed yet: rows [n, 3H] for positions start .. start+n-1."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class EagleDrafter:
    """The drafter interface (`propose`, `rollback`) plus what a feature drafter needs:
    `target_layers` (the target returns those layers' inputs with its logits) and `observe`
    (the target's features after each verification). State per sequence: `seq.draft_state`."""

    def __init__(self, runner: ModelRunner, confidence_threshold: float | None = None):
        if confidence_threshold is not None and not 0 < confidence_threshold < 1:
            raise ValueError(f"draft confidence_threshold must be in (0, 1), got {confidence_threshold}")
        self.runner = runner
        self.model: EagleModel = runner.model
        self.target_layers = self.model.config.aux_layers
        self.confidence_threshold = confidence_threshold
        self.draft_ids = self.model.draft_to_target(torch.arange(self.model.config.draft_vocab_size, device=runner.device))

    def observe(self, seqs: list[Sequence], starts: list[int], num_fed: list[int], hidden: torch.Tensor) -> None:
        """hidden: [sum(num_fed), 3H], the target's features for the positions it was just fed
        (sequence b: starts[b] .. starts[b] + num_fed[b] - 1). Keeps those the target kept
        (positions < seq.target.num_cached, after its rollback) as the sequence's pending features."""
        row = 0
        for s, start, n in zip(seqs, starts, num_fed):
            kept = hidden[row : row + max(0, s.target.num_cached - start)]
            row += n
            pending = s.draft_state
            if pending is not None and pending.end == start:
                pending.rows = torch.cat([pending.rows, kept])
            else:
                s.draft_state = PendingFeatures(start, kept)

    def ready(self, s: Sequence, n: int) -> bool:
        """Can s draft n tokens now: the features for every position the draft has not cached are
        there (not in a new sequence's first step: its prefill brings them), and the draft's context allows them."""
        pending = s.draft_state
        return (pending is not None and pending.start == s.draft.num_cached and pending.end == len(s) - 1
                and pending.end > pending.start and len(s) - 2 + n <= self.runner.max_positions)

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Catch-up forward, then chained forwards: up to num_draft[b] tokens for sequence b.
        Returns draft token lists (target ids) and draft_probs [B, K+1, V] (q over the full
        vocabulary, zero rows past each list), None when every request is greedy."""
        B, K = len(seqs), max(num_draft)
        V = self.model.config.layer.vocab_size
        greedy = all(s.params.greedy for s in seqs)
        draft_lists: list[list[int]] = [[] for _ in seqs]
        draft_probs = None if greedy else torch.zeros(B, K + 1, V, device=self.runner.device)  # [B, K+1, V]
        active = [b for b in range(B) if num_draft[b] > 0 and self.ready(seqs[b], num_draft[b])]
        if not active:
            return draft_lists, draft_probs
        # 1. Catch-up: positions draft.num_cached .. len-2, tokens x_{p+1}, the real features.
        feeds = [Feed(seqs[b].draft, seqs[b].tokens[seqs[b].draft.num_cached + 1 :]) for b in active]
        hidden = torch.cat([seqs[b].draft_state.rows for b in active])  # [sum, 3H]
        for b in active:
            seqs[b].draft_state = None  # consumed; observe() starts a new one after the verification
        project = True
        for i in range(K):
            logits, g = self.runner.forward(feeds, hidden=hidden, project=project)  # [n, V_d], [n, H]
            logits, ok = drop_nonfinite(logits)  # [n, V_d], [n]
            if greedy:
                best = logits.argmax(-1)  # [n] draft ids
                sampled = self.draft_ids[best]  # [n] target ids
                own = logits.softmax(-1).gather(-1, best[:, None]).squeeze(-1) if self.confidence_threshold else None
            else:  # unusable rows draw no random number, so the host needs `ok` before sampling
                # q over the draft vocabulary: what warping the full row (-inf outside it) gives there,
                # since the warp depends on the distribution only; sampling by inverse CDF over the
                # ascending draft ids draws what the full row would (its CDF is flat outside them).
                q = warp_probs(logits, [seqs[b].params for b in active])  # [n, V_d]
                drawn = sample(q, [seqs[b].generator if u else None for b, u in zip(active, ok.tolist())])  # [n] draft ids
                sampled = self.draft_ids[drawn]  # [n] target ids
                own = logits.softmax(-1).gather(-1, drawn[:, None]).squeeze(-1) if self.confidence_threshold else None
            sampled, usable, confident = to_host(sampled, ok, None if own is None else own >= self.confidence_threshold)
            for row, (b, t) in enumerate(zip(active, sampled)):
                if usable[row]:
                    draft_lists[b].append(t)
                    if not greedy:
                        draft_probs[b, i, self.draft_ids] = q[row]  # 0 outside the draft vocabulary
            # 2. Chained: the next position reads the drafted token and this step's own output g.
            keep = [row for row, (b, c, u) in enumerate(zip(active, confident, usable)) if c and u and num_draft[b] > i + 1]
            if not keep:
                break
            active = [active[row] for row in keep]
            feeds = [Feed(seqs[b].draft, [draft_lists[b][-1]]) for b in active]
            hidden, project = g[keep], False
        return draft_lists, draft_probs

    def rollback(self, seqs: list[Sequence]) -> None:
        """Forget the chained positions: the next catch-up starts at the first position whose
        target features are pending (the target's verified positions since the last catch-up)."""
        for s in seqs:
            keep = s.draft_state.start if s.draft_state is not None else len(s) - 1
            s.draft.truncate(keep, self.runner.cache.allocator)
