"""Model configuration: the core's dataclass (core/config.py), built from a Hugging Face
`config.json` dict; the dict is checked here, the numbers by the dataclass.

Both config styles are accepted: transformers >= 5 writes `rope_parameters` and `dtype`; older
checkpoints have top-level `rope_theta`, `rope_scaling` and `torch_dtype`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.config import ModelConfig as CoreModelConfig

__all__ = ["DTYPES", "SUPPORTED_ROPE_TYPES", "ModelConfig", "as_id_list", "hf_family", "hf_rope"]

# architecture name in config.json -> model family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig(CoreModelConfig):
    """The core's ModelConfig (core/config.py), built from a Hugging Face `config.json` dict, with
    RoPE's long-context scalings (linear, Llama 3.1) and the parameter count."""

    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)

    @property
    def num_parameters(self) -> int:
        """Weights the config implies (biases left out): embedding, an untied LM head, and per
        layer q/k/v/o ((Hq + 2 Hkv) D H + Hq D H), gate/up/down (3 H I) and two norms."""
        h, d = self.hidden_size, self.head_dim
        attention = (2 * self.num_heads + 2 * self.num_kv_heads) * d * h
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + self.num_layers * layer + h

    def rope_inv_freq(self) -> torch.Tensor:
        """The core's frequencies [head_dim // 2] fp32, with linear or Llama-3.1 scaling."""
        inv_freq = super().rope_inv_freq()  # [d/2]
        scaling = self.rope_scaling
        if scaling is None:
            return inv_freq
        factor = float(scaling["factor"])
        if scaling["rope_type"] == "linear":
            return inv_freq / factor
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling.get("original_max_position_embeddings", self.max_position_embeddings))
        wavelen = 2 * math.pi / inv_freq  # [d/2]
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed `config.json`. Raises ValueError naming what is wrong or unsupported."""
        family = hf_family(hf)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json is missing required field {key!r}")
            positive_int(hf, key)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ValueError(f"checkpoint dtype {dtype_name!r} is not supported ({sorted(DTYPES)})")
        theta, scaling = hf_rope(hf)
        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=positive_int(hf, "num_key_value_heads") if hf.get("num_key_value_heads") is not None else num_heads,
            head_dim=positive_int(hf, "head_dim") if hf.get("head_dim") is not None else hf["hidden_size"] // num_heads,
            rms_norm_eps=positive_number(hf, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=positive_int(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=hf_sliding_window(hf, family),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            dtype=DTYPES[dtype_name],
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=as_id_list(hf.get("eos_token_id"), "config.json eos_token_id"),
        )


def check_rope_scaling(scaling: dict) -> None:
    """Each scaling type's parameters are positive numbers (llama3: high > low factor)."""
    kind = scaling.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported "
                         f"(supported: {SUPPORTED_ROPE_TYPES})")
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in needed.get(kind, ()):
        value = scaling.get(key)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"rope scaling {kind!r} needs a positive number {key!r}, got {value!r}")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError("rope scaling 'llama3' needs high_freq_factor > low_freq_factor, "
                         f"got {scaling}")


def hf_family(hf: dict) -> str:
    """The model family of a config.json's first known architecture."""
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ValueError(f"unknown architecture {archs or hf.get('model_type')!r}; minispec supports {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[known[0]]


def hf_rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config style: transformers 5 nests both in
    rope_parameters; older checkpoints have top-level rope_theta and rope_scaling."""
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta > 0):
        raise ValueError(f"config.json rope_theta must be a positive number, got {theta!r}")
    scaling = rope or hf.get("rope_scaling") or None
    if scaling is not None:
        scaling = dict(scaling)
        old_name = scaling.pop("type", None)  # the key's pre-2024 name; "rope_type" wins, as in transformers
        scaling["rope_type"] = scaling.get("rope_type") or old_name or "default"
        if scaling["rope_type"] == "default":
            scaling = None
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return float(theta), scaling


def hf_sliding_window(hf: dict, family: str) -> int | None:
    """Mistral's window (transformers' default, 4096, when config.json has no key; null: none);
    Llama has none, and Qwen2 checkpoints carry a value they use only when asked to."""
    if family == "qwen2" and hf.get("use_sliding_window", False):
        raise ValueError("Qwen2 use_sliding_window=True (per-layer windows) is not supported")
    return hf.get("sliding_window", MISTRAL_DEFAULT_WINDOW) if family == "mistral" else None


MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig default


def positive_int(hf: dict, key: str, default=None) -> int:
    value = hf.get(key, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"config.json field {key!r} must be a positive int, got {value!r}")
    return value


def positive_number(hf: dict, key: str, default: float) -> float:
    value = hf.get(key, default)
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"config.json field {key!r} must be a positive number, got {value!r}")
    return float(value)


def as_id_list(value, what: str) -> list[int]:
    """An eos_token_id field (absent, one id or a list of ids) -> a list of ids."""
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{what} must be a token id or a list of them, got {value!r}")
    return list(ids)
