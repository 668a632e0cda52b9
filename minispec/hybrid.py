"""Lookup first, model otherwise: a drafter that copies from the context when it repeats itself.

Answers quote their prompt (a passage to rewrite, code to fix, names) and repeat themselves; there
prompt lookup (drafters.NgramDrafter) proposes the continuation of the latest earlier occurrence
of the sequence's last n tokens for free, where a model drafter spends a forward per token and
may still guess wrong. Elsewhere lookup finds nothing and the model drafts. Per sequence and
step, this drafter asks lookup first, for a match of at least `min_match` tokens, and gives the
sequences it found nothing for to the model drafter (a draft model or an EAGLE head): the
retrieval-first hybrids of SAM decoding (Hu et al. 2024) and SuffixDecoding (Oliaro et al. 2024),
with lookup over the sequence's own tokens.

Exactness. The choice depends only on the sequence's tokens so far, never on a random number,
so each step's proposal has a well-defined q: one-hot at each looked-up token, the model's warped
distribution otherwise; the verifier is told that q, so the output law is the target's
(speculative.py). Looked-up steps draw no random numbers: a seeded request stays reproducible.
The model drafter skips the looked-up steps: a draft model catches up on their tokens, an EAGLE
head on their target features, the next time it drafts (both already catch up every step).
"""

from __future__ import annotations

import torch

from .drafters import NgramDrafter
from .sequence import Sequence
from .speculative import one_hot_q


class LookupFirstDrafter:
    """`propose` / `rollback` (and a feature drafter's `target_layers` / `observe`, passed on)."""

    def __init__(self, model_drafter, min_match: int, max_match: int | None = None):
        """model_drafter: a drafters.ModelDrafter or eagle.EagleDrafter; lookup matches the last
        n tokens for n from max(max_match, min_match) down to min_match (the longest match wins)."""
        self.model_drafter = model_drafter
        self.lookup = NgramDrafter(max(max_match or min_match, min_match), min_match)
        self.lookup_drafts = self.model_drafts = 0  # sequence-steps drafted by each (what bench reports)
        if hasattr(model_drafter, "target_layers"):  # a feature drafter: the verifier hands it the target's features
            self.target_layers = model_drafter.target_layers
            self.observe = model_drafter.observe

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Lookup's tokens for the sequences with a match, the model's for the others. Returns draft
        lists and draft_probs [B, K+1, V] (one-hot rows for looked-up tokens), None when every
        request is greedy (then every q is one-hot: the verifier needs none)."""
        looked_up = [self.lookup.lookup(s.tokens, n) if n > 0 else [] for s, n in zip(seqs, num_draft)]
        model_draft = [0 if found else n for found, n in zip(looked_up, num_draft)]
        if max(model_draft) > 0:
            lists, model_probs = self.model_drafter.propose(seqs, model_draft)
        else:
            lists, model_probs = [[] for _ in seqs], None
        self.lookup_drafts += sum(1 for found in looked_up if found)
        self.model_drafts += sum(1 for drafted in lists if drafted)  # (an EAGLE head not ready yet drafts none)
        lists = [found or drafted for found, drafted in zip(looked_up, lists)]
        if all(s.params.greedy for s in seqs):
            return lists, None
        K = max(len(d) for d in lists)
        V = model_probs.shape[-1] if model_probs is not None else self.vocab_size
        device = model_probs.device if model_probs is not None else self.model_drafter.runner.device
        probs = torch.zeros(len(seqs), K + 1, V, device=device)  # [B, K+1, V]
        if model_probs is not None:
            width = min(K + 1, model_probs.shape[1])
            probs[:, :width] = model_probs[:, :width]  # rows of looked-up sequences are zero there
        for b, found in enumerate(looked_up):
            if found:
                probs[b, : len(found)] = one_hot_q(found, V, device)
        return lists, probs

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary (the width of q)."""
        drafter = self.model_drafter
        return getattr(drafter, "vocab_size", None) or drafter.model.config.layer.vocab_size

    def rollback(self, seqs: list[Sequence]) -> None:
        self.model_drafter.rollback(seqs)
