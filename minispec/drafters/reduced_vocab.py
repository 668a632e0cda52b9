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
ties go to the lower id (a byte-level BPE numbers tokens in merge order). Counting takes about a
minute, so the counts (one per token id) are made once per tokenizer and corpus and kept in the
cache directory; every N is then taken from them. `frequent_tokens(..., corpus=)` takes any other
text (e.g. the target's own answers), counted each time.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..io.paths import cache_dir, write_atomic
from ..io.tokenizer import Tokenizer

CORPUS_FILES = 4  # every 4th standard-library module (tests left out): ~27M characters


def stdlib_corpus() -> list[str]:
    """The corpus: the text of every CORPUS_FILES-th module of this Python's standard library."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [f for i, f in enumerate(files) if i % CORPUS_FILES == 0 and "test" not in f.parts]
    return [f.read_text(encoding="utf-8", errors="ignore") for f in files]


def stdlib_corpus_id() -> str:
    """What names the default corpus in the cache (without reading it): this Python's version,
    the folder of its standard library, and CORPUS_FILES. Caveat: where that folder holds
    site-packages (a Python used without a virtual environment), the corpus includes the packages
    installed there, and they are not in its name: counts made before a package is installed or
    upgraded are kept (they only steer which tokens are kept; the output stays exact)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return f"python {sys.version.split()[0]}, {stdlib}, every {CORPUS_FILES}th module"


def count_tokens(tokenizer: Tokenizer, corpus: list[str]) -> np.ndarray:
    """How often each of the tokenizer's ids occurs in the corpus as it encodes it:
    int64 [tokenizer.vocab_size]."""
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)  # [V_tok]
    for encoding in tokenizer.tok.encode_batch(corpus):
        ids = np.asarray(encoding.ids, dtype=np.int64)  # [tokens]
        counts += np.bincount(ids[ids < len(counts)], minlength=len(counts))
    return counts


def stdlib_counts(tokenizer: Tokenizer) -> np.ndarray:
    """count_tokens over stdlib_corpus(), from the cache when it holds them for this tokenizer and
    corpus (else counted, about a minute, and cached).

    A cache file that is not what this code writes (not JSON, cut short, another tokenizer's or
    corpus's counts, a count per id missing or not a non-negative int) is counted again and
    replaced, with a warning naming the file and what is wrong with it. Not an error: the file is
    derived data that a recount restores exactly, and it is written atomically, so a bad one came
    from outside (an older minispec killed while writing, a full disk, a hand edit); refusing to
    run until the user deletes it would only add a step. Not silent either: a cache that keeps
    going bad is worth knowing about."""
    tokenizer_id = hashlib.sha256(tokenizer.tok.to_str().encode()).hexdigest()
    header = {"tokenizer": tokenizer_id, "corpus": stdlib_corpus_id()}
    key = hashlib.sha256(json.dumps(header).encode()).hexdigest()[:16]
    path = cache_dir() / "vocab" / f"counts-{key}.json"
    if path.exists():
        try:
            return read_counts(path, header, tokenizer.vocab_size)
        except ValueError as e:
            warnings.warn(f"{e}; counting the corpus again to replace it", RuntimeWarning, stacklevel=3)
    print(f"[minispec] counting the tokens of the standard library once into {path}", file=sys.stderr)
    counts = count_tokens(tokenizer, stdlib_corpus())
    write_atomic(path, json.dumps({**header, "counts": counts.tolist()}))
    return counts


def read_counts(path: Path, header: dict, size: int) -> np.ndarray:
    """The counts in a cache file that stdlib_counts wrote for `header`, checked: int64 [size];
    a ValueError naming the file and what is wrong with it otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"token counts cache {path} is not valid JSON ({e})") from None
    fields = {*header, "counts"}
    if not isinstance(data, dict) or set(data) != fields:
        raise ValueError(f"token counts cache {path} is not an object with the fields {sorted(fields)}")
    if {k: data[k] for k in header} != header:
        raise ValueError(f"token counts cache {path} holds the counts of another tokenizer or corpus")
    counts = data["counts"]
    if not isinstance(counts, list) or len(counts) != size:
        raise ValueError(f"token counts cache {path} must hold {size} counts (one per token id), "
                         f"not {len(counts) if isinstance(counts, list) else type(counts).__name__}")
    if not all(type(c) is int and c >= 0 for c in counts):
        raise ValueError(f"token counts cache {path} holds a count that is not a non-negative int")
    return np.array(counts, dtype=np.int64)


def frequent_tokens(tokenizer: Tokenizer, n: int, vocab_size: int, corpus: list[str] | None = None) -> torch.Tensor:
    """The n ids kept, among ids 0..vocab_size-1 (sorted, distinct; int64 [n]): the tokenizer's
    special tokens, then by frequency in the corpus (default: stdlib_corpus(), its counts cached),
    ties to the lower id."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}] (the target's vocabulary), got {n}")
    counted = count_tokens(tokenizer, corpus) if corpus is not None else stdlib_counts(tokenizer)
    counts = np.zeros(vocab_size, dtype=np.int64)  # [vocab_size]: ids past the tokenizer's never occur
    counts[: min(vocab_size, len(counted))] = counted[:vocab_size]
    special = np.zeros(vocab_size, dtype=bool)  # [vocab_size]
    special_ids = {*tokenizer.tok.get_added_tokens_decoder(), *tokenizer.eos_token_ids}
    special[[i for i in special_ids if i < vocab_size]] = True
    # Special first, then the most frequent, ties to the lower id (np.lexsort: the last key leads).
    order = np.lexsort((np.arange(vocab_size), -counts, ~special))  # [vocab_size]
    return torch.from_numpy(np.sort(order[:n])).to(torch.int64)


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
