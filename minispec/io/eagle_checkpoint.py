"""EAGLE-3 checkpoints: the official layout read into an `EagleModel` for a given target, and written.

Layout: config.json (a Llama config with num_hidden_layers 1, draft_vocab_size, optional
target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids, norm_before_residual) and
model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d). The embedding is the target's,
shared (a checkpoint's own embed_tokens.weight, if present, is used instead). Every mismatch with
the target is a ValueError naming both sides.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..fast.cpu_linear import use_cpu_fast_paths
from ..model.eagle import EagleConfig, EagleModel
from ..fast.fusion import checkpoint_state_dict, fuse_projections
from ..model.llama import Transformer
from .checkpoint import check_tensors, read_safetensors, resolve_dtype
from .tokenizer import read_json_object


def is_eagle_checkpoint(path: str | Path) -> bool:
    """A directory whose config.json names a draft vocabulary or an Eagle architecture."""
    if not isinstance(path, (str, Path)):
        return False
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    hf = read_json_object(config)
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
    model.inv_freq = cfg.layer.rope_inv_freq().to(device)
    fuse_projections(model)
    use_cpu_fast_paths(model, dtype, device, prefer=target.cpu_matmul, own_weights=True)
    return model.eval()


def load_eagle(path: str | Path, target: Transformer, dtype: str | torch.dtype | None = None) -> EagleModel:
    """Load an EAGLE-3 checkpoint directory for `target` (same device; the target's dtype unless given)."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"EAGLE checkpoint {path} has no config.json")
    where = f"EAGLE checkpoint {path}"
    cfg = EagleConfig.from_hf(read_json_object(config), target.cfg, where)
    dtype = target.dtype if dtype in (None, "auto") else resolve_dtype(dtype, cfg.layer, target.device)
    return build_eagle(cfg, read_safetensors(path), target, dtype, where)


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
    if model.quantization is not None:
        raise ValueError("save_eagle writes the full-precision layout; this head is quantized (int8 buffers)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in checkpoint_state_dict(model).items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(model.config, dtype), indent=2) + "\n")


def check_head_fits(head: EagleModel, target: Transformer) -> None:
    """An EAGLE head passed already built must have been built for this target: its config is held
    against the target's by the same checks a checkpoint's config.json gets, and it must share the
    target's embedding shape (else the first draft step would fail inside a matmul)."""
    where = "the EAGLE head passed as draft_model"
    EagleConfig.from_hf(hf_config(head.config), target.cfg, where)
    embedding, expected = tuple(head.embed_weight.shape), tuple(target.embed_tokens.weight.shape)
    if embedding != expected:
        raise ValueError(f"{where} holds an embedding of shape {embedding}; the target's is {expected}")
