"""What an `LLM` is built from: one dataclass of options, validated when it is made.

vLLM's spellings are accepted and translated here, so the rest of minispec sees one of each:
`speculative_model=` (older vLLM) and `speculative_config={"method", "model",
"num_speculative_tokens", "quantization", "prompt_lookup_min", "prompt_lookup_max", "tree_budget",
"tree_top_k"}` (current vLLM, plus our tree keys) become `draft_model`, `num_speculative_tokens`
(k), `draft_quantization`, the lookup window and the draft tree. Every bad value is a
ValueError naming the option before anything is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .fast.int4 import check_draft_quantization
from .fast.int8 import check_quantization
from .io.eagle_checkpoint import is_eagle_checkpoint
from .io.tokenizer import Tokenizer
from .model.eagle import EagleModel
from .model.llama import Transformer
from .pathwise import PATHWISE_SAMPLING

DRAFT_ONLY = ("int4",)  # quantizations that only a draft model takes (fast/int4.py)
Model = str | Path | tuple[Transformer, Tokenizer]
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class EngineOptions:
    """model / draft_model: an HF checkpoint dir, a .gguf file, or an already built (Transformer,
    Tokenizer) pair; draft_model="ngram" selects prompt-lookup drafting; an EAGLE-3 checkpoint dir
    (config.json with draft_vocab_size) or a built EagleModel selects the feature drafter.
    num_speculative_tokens (k, 4 by default): tokens drafted per step, at most. kv_cache_gib: KV budget
    of all pools (default: gpu_memory_utilization of free GPU memory, 1 GiB on CPU), split by KV size.
    draft_confidence_threshold: adaptive draft length for a draft model or head; each step drafts
    up to k, stopping after a token the drafter gave probability < threshold (a draft tree: it
    stops growing at a level whose likeliest node has path probability < threshold).
    prompt_lookup_min (with a draft model or EAGLE head): a sequence whose last n >= this many tokens
    occurred earlier drafts what followed them (no forward; drafters/lookup.py), the model elsewhere.
    cuda_graphs (default: on CUDA): static-shape steps captured as CUDA graphs (a failed capture is an
    error naming the bucket); static_shapes (default: cuda_graphs): that layout without graphs.
    quantization="int8": target and drafter with int8 weights (fast/int8.py; exact for that int8
    target); models passed built must have been loaded so (never quantized in place).
    draft_quantization="int4" (CPU): a draft model in int4 (fast/int4.py; it overrides `quantization`
    for the draft); draft_vocab_size=N: its LM head over N frequent tokens (drafters/reduced_vocab.py).
    Both exact, as any draft is. row_invariant=True (CPU): each row of the target computed alike in
    any batch, greedy speculative == plain bit for bit (fast/row_invariant.py; built models in place).
    ngram_max / ngram_min (3 / 1): the n-gram drafter's window, or a lookup's longest match (ngram_max).
    seed: requests without their own seed draw from a generator seeded with it. pathwise_sampling:
    which requests that do not say (SamplingParams.pathwise) sample by Gumbel-max keyed by (seed,
    position), so that the drafter, k and speculation by load cannot change their tokens
    (pathwise.py): "off" (default) none, "seeded" those with a seed, "on" all; True / False are
    "on" / "off". Serving (runtime/):
    enable_prefix_caching, speculation_by_load (a chain's k from step costs), enable_chunked_prefill.
    tokenizer: a directory with tokenizer.json to use instead of the target's. enforce_eager=True: no
    CUDA graphs. tensor_parallel_size must be 1 (one device); dtype also takes vLLM's "half", "float".
    draft_tree_budget (a draft model or EAGLE-3 head): a tree of this many nodes (1..63) per step, k deep
    at most, each expanded node getting its draft_tree_top_k (4) likeliest children (drafters/tree.py)."""

    model: Model
    draft_model: Model | EagleModel | None = None
    num_speculative_tokens: int | None = None
    speculative_model: Model | None = None
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1
    dtype: str | torch.dtype | None = "auto"
    quantization: str | None = None
    draft_quantization: str | None = None
    row_invariant: bool = False
    draft_vocab_size: int | None = None
    device: str | None = None
    backend: str | None = None
    page_size: int = 16
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = False
    speculation_by_load: bool = False
    enable_chunked_prefill: bool = False
    max_model_len: int | None = None
    ngram_max: int | None = None
    ngram_min: int | None = None
    draft_confidence_threshold: float | None = None
    prompt_lookup_min: int | None = None
    draft_tree_budget: int | None = None
    draft_tree_top_k: int | None = None
    cuda_graphs: bool | None = None
    static_shapes: bool | None = None
    seed: int | None = None
    pathwise_sampling: str | bool = "off"
    tokenizer: str | Path | None = None
    enforce_eager: bool = False
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.quantization in DRAFT_ONLY:  # (its matmul is fast at one row, slower than bf16 at a verification's k+1)
            raise ValueError(f"quantization={self.quantization!r} is for a draft model only: draft_quantization={self.quantization!r}")
        check_quantization(self.quantization)
        for name in ("row_invariant", "enable_prefix_caching", "speculation_by_load", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.pathwise_sampling, bool):
            self.pathwise_sampling = "on" if self.pathwise_sampling else "off"
        if self.pathwise_sampling not in PATHWISE_SAMPLING:
            raise ValueError(f"pathwise_sampling must be one of {', '.join(PATHWISE_SAMPLING)} (or True / False), "
                             f"got {self.pathwise_sampling!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        self.check_device()
        self.translate_vllm()
        self.check_drafter()
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "ngram_max", "ngram_min"):
            check_int(name, getattr(self, name), 1)
        for name in ("max_model_len", "seed"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0 if name == "seed" else 1, 2**63 - 1 if name == "seed" else None)
        for name in ("kv_cache_gib", "gpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.gpu_memory_utilization > 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.enforce_eager:
            if self.cuda_graphs:
                raise ValueError("enforce_eager=True and cuda_graphs=True contradict each other")
            self.cuda_graphs = False

    def check_device(self) -> None:
        """cpu or cuda (a device minispec can run a forward on), named before anything loads."""
        if self.device is None:
            return
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {self.device!r} is not a device name ({e})") from None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: minispec runs on 'cpu' or 'cuda' devices")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: no CUDA device is available here")

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
        if self.draft_model is None and self.num_speculative_tokens is not None:
            raise ValueError("num_speculative_tokens needs a drafter (draft_model, speculative_model or speculative_config)")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 4
        if (lookup.get("prompt_lookup_max") or math.inf) < (lookup.get("prompt_lookup_min") or 0):
            raise ValueError(f"speculative_config's prompt_lookup_max {lookup['prompt_lookup_max']} is below its "
                             f"prompt_lookup_min {lookup['prompt_lookup_min']}")
        if self.uses_ngram:  # vLLM's n-gram window
            for key, name in (("prompt_lookup_min", "ngram_min"), ("prompt_lookup_max", "ngram_max")):
                if key in lookup and getattr(self, name) not in (None, lookup[key]):
                    raise ValueError(f"{name}={getattr(self, name)} disagrees with speculative_config's {key} {lookup[key]}")
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
        tree = {"tree_budget": "draft_tree_budget", "tree_top_k": "draft_tree_top_k"}
        tree = {**tree, "quantization": "draft_quantization"}
        unknown = sorted(set(config) - {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", *window, *tree})
        if unknown:
            raise ValueError(f"speculative_config keys not supported: {unknown} (use method, model, num_speculative_tokens, "
                             "quantization, prompt_lookup_min, prompt_lookup_max, tree_budget, tree_top_k, draft_tensor_parallel_size)")
        for key, name in tree.items():
            if config.get(key) is not None:
                if getattr(self, name) is not None and getattr(self, name) != config[key]:
                    raise ValueError(f"{name}={getattr(self, name)} disagrees with speculative_config's {key} {config[key]}")
                setattr(self, name, config[key])
        if config.get("draft_tensor_parallel_size", 1) not in (None, 1):
            raise ValueError(f"speculative_config's draft_tensor_parallel_size must be 1 (one device), "
                             f"got {config['draft_tensor_parallel_size']!r}")
        method, model = config.get("method"), config.get("model")
        if method == "ngram" or (method is None and model == "ngram"):
            if model not in (None, "ngram"):
                raise ValueError(f"speculative_config method 'ngram' drafts without a model; drop 'model' ({model!r}) "
                                 "or use method 'draft_model' / 'eagle3'")
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
        if isinstance(self.draft_model, (str, Path)) and not self.uses_ngram and not Path(self.draft_model).exists():
            raise ValueError(f"draft_model {str(self.draft_model)!r}: no such file or directory (a draft model's HF "
                             "directory or .gguf, an EAGLE-3 directory, or 'ngram')")  # before the target loads
        if self.draft_model is not None:
            check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 32)
        for name in ("prompt_lookup_min", "ngram_min", "ngram_max"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        given = [name for name in ("ngram_min", "ngram_max") if getattr(self, name) is not None]
        if given and not self.uses_ngram and self.prompt_lookup_min is None:
            raise ValueError(f"{' and '.join(given)} set the n-gram drafter's window (draft_model='ngram') or, with "
                             "prompt_lookup_min, the lookup in front of a model; neither drafts here")
        if self.prompt_lookup_min is not None and self.ngram_max is not None and self.ngram_max < self.prompt_lookup_min:
            raise ValueError(f"ngram_max {self.ngram_max} (the longest lookup match) is below prompt_lookup_min "
                             f"{self.prompt_lookup_min} (the shortest)")
        if "ngram_min" in given and not self.uses_ngram:
            raise ValueError("ngram_min is the n-gram drafter's; in front of a model the shortest match is prompt_lookup_min")
        self.ngram_min = 1 if self.ngram_min is None else self.ngram_min
        self.ngram_max = 3 if self.ngram_max is None else self.ngram_max
        if self.draft_confidence_threshold is not None and not self.uses_model_drafter:
            raise ValueError("draft_confidence_threshold needs a draft model (the n-gram drafter has no probabilities)")
        threshold = self.draft_confidence_threshold
        if threshold is not None and not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                                          and 0 < threshold < 1):
            raise ValueError(f"draft_confidence_threshold must be in (0, 1), got {threshold!r}")
        if self.prompt_lookup_min is not None and not self.uses_model_drafter:
            raise ValueError("prompt_lookup_min puts prompt lookup in front of a draft model or EAGLE head; "
                             "give one as draft_model (the n-gram drafter alone takes ngram_min / ngram_max)")
        self.check_tree()
        self.check_draft_model_options()

    def check_draft_model_options(self) -> None:
        """draft_quantization and draft_vocab_size: for a draft model (not an EAGLE head, n-gram or
        plain decoding), on a device and torch with the kernel; a reduced vocabulary from a path."""
        model, quantization, size = self.draft_model, self.draft_quantization, self.draft_vocab_size
        eagle = isinstance(model, EagleModel) or (isinstance(model, (str, Path)) and is_eagle_checkpoint(model))
        for name, value in (("draft_quantization", quantization), ("draft_vocab_size", size)):
            if value is not None and (not self.uses_model_drafter or eagle):
                raise ValueError(f"{name}={value!r} is for a draft model (draft_model: its path; an EAGLE head has "
                                 "neither: one layer fed by the target, with its own draft vocabulary)")
        if quantization is not None:
            check_draft_quantization(quantization, torch.device(self.device) if self.device else None)
            if isinstance(model, tuple) and model[0].quantization != quantization:
                raise ValueError(f"draft_quantization={quantization!r} but draft_model was passed already built with "
                                 f"{model[0].quantization or 'full-precision'} weights: load it with "
                                 f"load_checkpoint(..., quantization={quantization!r}) or pass its path")
        if size is not None:
            check_int("draft_vocab_size", size, 1)
            if isinstance(model, tuple):
                raise ValueError("draft_vocab_size needs the draft model's path (a built one: drafters.reduced_vocab.reduce_vocab)")
            if (quantization or self.quantization) == "int8":
                raise ValueError("draft_vocab_size with an int8 draft is not supported (use draft_quantization='int4' or none)")

    def check_tree(self) -> None:
        """The draft tree's options: a budget of 1..63 nodes, top_k >= 1, and the head's scratch
        for the fed frontiers ((k - 1) * top_k nodes) within one 63-bit mask; a head drafts it."""
        if self.draft_tree_top_k is not None and self.draft_tree_budget is None:
            raise ValueError("draft_tree_top_k shapes a draft tree; set draft_tree_budget (its node count) too")
        if self.draft_tree_budget is None:
            return
        check_int("draft_tree_budget", self.draft_tree_budget, 1, 63)
        self.draft_tree_top_k = 4 if self.draft_tree_top_k is None else self.draft_tree_top_k
        check_int("draft_tree_top_k", self.draft_tree_top_k, 1, 63)
        if not self.uses_model_drafter:
            raise ValueError("draft_tree_budget needs a draft model or an EAGLE-3 head as draft_model (it grows the tree)")
        fed = (self.num_speculative_tokens - 1) * self.draft_tree_top_k
        if fed > 63:
            raise ValueError(f"a draft tree {self.num_speculative_tokens} levels deep with top_k {self.draft_tree_top_k} feeds "
                             f"{fed} nodes to the drafter; at most 63 fit its tree mask (lower num_speculative_tokens or draft_tree_top_k)")


def check_int(name: str, value, low: int, high: int | None = None) -> None:
    """A ValueError naming the argument unless value is an int (not a bool) in [low, high]."""
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)):
        raise ValueError(f"{name} must be an int in [{low}, {high if high is not None else 'inf'}], got {value!r}")
