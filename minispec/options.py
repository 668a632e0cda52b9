"""What an `LLM` is built from: one dataclass of options, validated when it is made.

vLLM's spellings are accepted and translated here, so the rest of minispec sees one of each:
`speculative_model=` (older vLLM) and `speculative_config={"method", "model",
"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}` (current vLLM) become
`draft_model`, `num_speculative_tokens` (k) and the lookup window. Every bad value is a
ValueError naming the option before anything is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .fast.int8 import check_quantization
from .io.eagle_checkpoint import is_eagle_checkpoint
from .io.tokenizer import Tokenizer
from .model.eagle import EagleModel
from .model.llama import Transformer

Model = str | Path | tuple[Transformer, Tokenizer]


@dataclass
class EngineOptions:
    """model / draft_model: an HF checkpoint dir, a .gguf file, or an already built (Transformer,
    Tokenizer) pair; draft_model="ngram" selects prompt-lookup drafting; an EAGLE-3 checkpoint dir
    (config.json with draft_vocab_size) or a built EagleModel selects the feature drafter.
    num_speculative_tokens (k, 4 by default): tokens drafted per step, at most.
    kv_cache_gib: KV budget for both pools together (default: gpu_memory_utilization of the free
    GPU memory on CUDA, 1 GiB on CPU), split in proportion to per-token KV size.
    draft_confidence_threshold: adaptive draft length for a draft model or head; each step drafts
    up to k, stopping after a token the drafter gave probability < threshold.
    prompt_lookup_min (with a draft model or EAGLE head): a sequence whose last n >= this many
    tokens occurred earlier in it drafts what followed that occurrence (no forward; n up to
    max(ngram_max, this)); the model drafts for the others (drafters/lookup.py).
    cuda_graphs (default: on CUDA): decode, verification and draft steps run with static shapes,
    captured as CUDA graphs at start-up (a failed capture warns once and runs them eagerly).
    static_shapes (default: cuda_graphs) runs that static layout without graphs, e.g. on CPU.
    quantization="int8": target and drafter with int8 weights and dynamic per-row activation
    scales (fast/int8.py); speculative output is exact for that int8 target. Models passed
    already built must have been loaded with it: they are never quantized in place.
    tensor_parallel_size must be 1 (one device)."""

    model: Model
    draft_model: Model | EagleModel | None = None
    num_speculative_tokens: int | None = None
    speculative_model: Model | None = None
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1
    dtype: str | torch.dtype | None = "auto"
    quantization: str | None = None
    device: str | None = None
    backend: str | None = None
    page_size: int = 16
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    draft_confidence_threshold: float | None = None
    prompt_lookup_min: int | None = None
    cuda_graphs: bool | None = None
    static_shapes: bool | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        self.translate_vllm()
        self.check_drafter()
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "ngram_max", "ngram_min"):
            check_int(name, getattr(self, name), 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)
        for name in ("kv_cache_gib", "gpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def uses_ngram(self) -> bool:
        return isinstance(self.draft_model, str) and self.draft_model == "ngram"

    @property
    def uses_model_drafter(self) -> bool:
        """A draft model or an EAGLE head (not the n-gram drafter, not plain decoding)."""
        return self.draft_model is not None and not self.uses_ngram

    def translate_vllm(self) -> None:
        """vLLM's ways of naming the drafter -> draft_model, num_speculative_tokens and, from
        speculative_config, the prompt lookup window (the n-gram drafter's with method ngram,
        else prompt lookup in front of the model, as prompt_lookup_min)."""
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1 (minispec runs on one device), got {self.tensor_parallel_size!r}")
        given = [name for name in ("draft_model", "speculative_model", "speculative_config") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"name the drafter once: got {' and '.join(given)}")
        if self.speculative_model is not None:
            self.draft_model, self.speculative_model = self.speculative_model, None
        lookup = {}
        if self.speculative_config is not None:
            lookup = self.translate_speculative_config(self.speculative_config)
            self.speculative_config = None
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 4
        if self.uses_ngram:  # vLLM's n-gram window
            self.ngram_min = lookup.get("prompt_lookup_min", self.ngram_min)
            self.ngram_max = lookup.get("prompt_lookup_max", self.ngram_max)
        elif lookup:  # prompt lookup in front of the model drafter
            if "prompt_lookup_min" not in lookup:
                raise ValueError("speculative_config's prompt_lookup_max with a draft model needs prompt_lookup_min "
                                 "(which puts prompt lookup in front of the model)")
            if self.prompt_lookup_min not in (None, lookup["prompt_lookup_min"]):
                raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} disagrees with speculative_config's "
                                 f"{lookup['prompt_lookup_min']}")
            self.prompt_lookup_min = lookup["prompt_lookup_min"]
            self.ngram_max = lookup.get("prompt_lookup_max", self.ngram_max)

    def translate_speculative_config(self, config: dict) -> dict:
        """Sets draft_model and num_speculative_tokens from vLLM's speculative_config; returns its
        lookup window ({"prompt_lookup_min": n, "prompt_lookup_max": n}, either key, or none)."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        window = ("prompt_lookup_min", "prompt_lookup_max")
        unknown = sorted(set(config) - {"method", "model", "num_speculative_tokens", *window})
        if unknown:
            raise ValueError(f"speculative_config keys not supported: {unknown} "
                             "(use method, model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)")
        method, model = config.get("method"), config.get("model")
        if method == "ngram" or (method is None and model == "ngram"):
            self.draft_model = "ngram"
        elif method in (None, "draft_model", "eagle", "eagle3"):
            if model is None:
                raise ValueError("speculative_config needs 'model' (a draft checkpoint) unless method is 'ngram'")
            if method in ("eagle", "eagle3") and not (isinstance(model, EagleModel) or is_eagle_checkpoint(model)):
                raise ValueError(f"speculative_config method {method!r} needs an EAGLE-3 checkpoint (config.json with "
                                 f"draft_vocab_size); {model!r} is not one")
            self.draft_model = model
        else:
            raise ValueError(f"speculative_config method {method!r} is not supported (use 'draft_model', 'eagle3' or 'ngram')")
        config_k = config.get("num_speculative_tokens")
        if self.num_speculative_tokens is not None and config_k is not None and config_k != self.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} disagrees with speculative_config's {config_k}")
        if config_k is not None:
            self.num_speculative_tokens = config_k
        return {key: config[key] for key in window if config.get(key) is not None}

    def check_drafter(self) -> None:
        if self.draft_model is not None:
            check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 32)
        if self.draft_confidence_threshold is not None and not self.uses_model_drafter:
            raise ValueError("draft_confidence_threshold needs a draft model (the n-gram drafter has no probabilities)")
        if self.prompt_lookup_min is not None:
            check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
            if not self.uses_model_drafter:
                raise ValueError("prompt_lookup_min puts prompt lookup in front of a draft model or EAGLE head; "
                                 "give one as draft_model (the n-gram drafter alone takes ngram_min / ngram_max)")


def check_int(name: str, value, low: int, high: int | None = None) -> None:
    """A ValueError naming the argument unless value is an int (not a bool) in [low, high]."""
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)):
        raise ValueError(f"{name} must be an int in [{low}, {high if high is not None else 'inf'}], got {value!r}")
