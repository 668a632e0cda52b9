"""ModelConfig: the hyper-parameters of a Llama-family decoder, validated when built, and the
RoPE frequencies they imply (unscaled: a long-context scaling is the production config's).

The fields are the decoder's shapes under the names model.py uses in its shape comments (H =
hidden_size, Hq = num_heads, Hkv = num_kv_heads, D = head_dim, I = intermediate_size, V =
vocab_size). Reading a checkpoint's `config.json` into one is the loaders' job (outside the core):
they check what the file says, this class checks that the numbers make a decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE's inverse frequencies theta^(-2i/d), i < d/2: [head_dim // 2] fp32, on the CPU
        whatever the default device (on the meta device, where a loader builds a model's
        skeleton, these ops would import torch's compiler stack: about a second of every load).
        A subclass may scale them for long contexts (the production config does)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
        return 1.0 / (self.rope_theta**exponents)  # [d/2], fp32 as in HF
