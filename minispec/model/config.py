"""Model configuration: one dataclass, built from a Hugging Face `config.json` dict and validated.

Both config styles are accepted: transformers >= 5 writes `rope_parameters` and `dtype`; older
checkpoints have top-level `rope_theta`, `rope_scaling` and `torch_dtype`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


# architecture name in config.json -> model family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder. Shapes below use these names."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # key j is visible to query i iff i - j < sliding_window
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dtype: torch.dtype = torch.float32  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # every end token; the first is THE EOS (the tokenizer's)

    def __post_init__(self) -> None:
        checks = {
            "vocab_size": self.vocab_size > 0,
            "hidden_size": self.hidden_size > 0,
            "num_layers": self.num_layers > 0,
            "num_heads": self.num_heads > 0,
            "num_kv_heads (must divide num_attention_heads)": self.num_kv_heads > 0
            and self.num_heads % self.num_kv_heads == 0,
            "head_dim": self.head_dim > 0 and self.head_dim % 2 == 0,
            "sliding_window": self.sliding_window is None or self.sliding_window > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid model config: bad {', '.join(bad)} in {self}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope scaling type {kind!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
                )
            needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(kind, ())
            for key in needed:
                value = self.rope_scaling.get(key)
                if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                    raise ValueError(f"rope scaling {kind!r} needs a positive number {key!r}, got {value!r}")
            if kind == "llama3" and not self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"]:
                raise ValueError(f"rope scaling 'llama3' needs high_freq_factor > low_freq_factor, got {self.rope_scaling}")

    @property
    def num_parameters(self) -> int:
        """Weights the config implies (biases left out): embedding, an untied LM head, and per
        layer q/k/v/o ((Hq + 2 Hkv) D H + Hq D H), gate/up/down (3 H I) and two norms."""
        h, d = self.hidden_size, self.head_dim
        layer = (2 * self.num_heads + 2 * self.num_kv_heads) * d * h + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + self.num_layers * layer + h

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

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


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), i < d/2, with linear or Llama-3.1 scaling. Returns [head_dim // 2] fp32,
    on the CPU whatever the default device (on the meta device, where the loaders build a model's
    skeleton, these ops would import torch's compiler stack: ~1 s of every load)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))  # [d/2], fp32 as in HF
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings", cfg.max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)
