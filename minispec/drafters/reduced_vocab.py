"""A reduced draft vocabulary for a draft model (FR-Spec, Zhao et al. 2025): its LM head keeps the
rows of the N most frequent tokens only, so each drafted token's head matmul reads N rows of W
instead of all V (Qwen2.5: 151,936), and q = 0 for every other token.

Why the output stays exact: the rule accepts x with probability min(1, p(x) / q(x)) and resamples
a rejection from norm(max(0, p - q)); for a token with q(x) = 0 the draft never proposes it and
the residual gives it its full p(x) (test_speculative_exact.py proves one step exactly for any q
that is zero off a subset, the EAGLE-3 head's d2t being the same case). A reduced vocabulary can
only lower acceptance, where the target's next token lies outside the N.

Which N tokens: counted over a corpus every Python installation has, its standard library's
source (code, and English in its docstrings and comments), tokenized by the target's own
tokenizer; every special token (the chat markers, the end tokens) is kept whatever its count, and
ties go to the lower id (a byte-level BPE numbers tokens in merge order). The list is computed
once per tokenizer and N and kept in the cache directory. `frequent_tokens(..., corpus=)` takes
any other text (e.g. the target's own answers).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ..io.tokenizer import Tokenizer

CORPUS_FILES = 4  # every 4th standard-library module (tests left out): ~27M characters


def stdlib_corpus() -> list[str]:
    """The corpus: the text of every CORPUS_FILES-th module of this Python's standard library."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [f for i, f in enumerate(files) if i % CORPUS_FILES == 0 and "test" not in f.parts]
    return [f.read_text(encoding="utf-8", errors="ignore") for f in files]


def frequent_tokens(tokenizer: Tokenizer, n: int, vocab_size: int, corpus: list[str] | None = None) -> torch.Tensor:
    """The n ids (sorted, int64 [n]) kept: the tokenizer's special tokens, then by frequency in the
    corpus (default: stdlib_corpus(), cached per tokenizer and n), ties to the lower id."""
    from ..io.paths import cache_dir

    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}] (the target's vocabulary), got {n}")
    key = hashlib.sha256(tokenizer.tok.to_str().encode()).hexdigest()[:16]
    cached = cache_dir() / "vocab" / f"{key}-{n}.json"
    if corpus is None and cached.exists():
        return torch.tensor(json.loads(cached.read_text()), dtype=torch.int64)
    counts = Counter()
    for encoding in tokenizer.tok.encode_batch(corpus if corpus is not None else stdlib_corpus()):
        counts.update(encoding.ids)
    special = {i for i in tokenizer.tok.get_added_tokens_decoder()} | set(tokenizer.eos_token_ids)
    order = sorted(range(vocab_size), key=lambda i: (i not in special, -counts.get(i, 0), i))
    ids = sorted(order[:n])
    if corpus is None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(ids))
    return torch.tensor(ids, dtype=torch.int64)


def reduce_vocab(model: nn.Module, ids: torch.Tensor) -> nn.Module:
    """Keep the draft model's LM head rows `ids` (int64 [N], target ids, sorted) only, in place:
    its logits become [T, N], column j scoring target token ids[j] (`model.vocab_ids`, which
    ModelDrafter reads as its draft_ids). The embedding stays whole (any token can be fed)."""
    if model.quantization is not None:
        raise ValueError(f"reduce the draft's vocabulary before quantizing it (this one is {model.quantization})")
    ids = torch.as_tensor(ids, dtype=torch.int64)
    head = model.lm_head
    weight = head.dense_weight() if hasattr(head, "dense_weight") else head.weight
    reduced = nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        reduced.weight.copy_(weight.detach()[ids.to(weight.device)])
        if head.bias is not None:
            reduced.bias.copy_(head.bias.detach()[ids.to(weight.device)])
    model.lm_head = reduced.requires_grad_(False)
    model.vocab_ids = ids.to(weight.device)
    return model


def reduce_to_frequent(model: nn.Module, tokenizer: Tokenizer, n: int) -> nn.Module:
    """`reduce_vocab` over the n `frequent_tokens` among the ids both the draft model and its
    tokenizer have (a checkpoint's embedding may be padded past the tokenizer's ids)."""
    return reduce_vocab(model, frequent_tokens(tokenizer, n, min(model.cfg.vocab_size, tokenizer.vocab_size)))
