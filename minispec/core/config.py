"""ModelConfig: the hyper-parameters of a Llama-family decoder, validated when built, and the
RoPE frequencies they imply.

The fields are the decoder's shapes under the names model.py uses in its shape comments (H =
hidden_size, Hq = num_heads, Hkv = num_kv_heads, D = head_dim, I = intermediate_size, V =
vocab_size). Reading a checkpoint's `config.json` into one is the loaders' job (outside the core):
they check what the file says, this class checks that the numbers make a decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
    eos_token_ids: list[int] = field(default_factory=list)  # every end token; the first is THE EOS

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

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads


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


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), i < d/2, with linear or Llama-3.1 scaling. Returns
    [head_dim // 2] fp32, on the CPU whatever the default device (on the meta device, where a
    loader builds a model's skeleton, these ops would import torch's compiler stack: about a
    second of every load)."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d  # [d/2]
    inv_freq = 1.0 / (cfg.rope_theta**exponents)  # [d/2], fp32 as in HF
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings", cfg.max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq  # [d/2]
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)
