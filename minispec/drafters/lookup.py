"""Lookup first, model otherwise: a drafter that copies from the context when it repeats itself.

Answers quote their prompt (a passage to rewrite, code to fix, names) and repeat themselves; there
prompt lookup (ngram.py) proposes the continuation of the latest earlier occurrence of the
sequence's last n tokens for free, where a model drafter spends a forward per token and may still
guess wrong. Elsewhere lookup finds nothing and the model drafts. Per sequence and step, this
drafter asks lookup first, for a match of at least `min_match` tokens, and gives the sequences it
found nothing for to the model drafter (a draft model or an EAGLE head): the retrieval-first
hybrids of SAM decoding (Hu et al. 2024) and SuffixDecoding (Oliaro et al. 2024), with lookup
over the sequence's own tokens.

Exactness. The choice depends only on the sequence's tokens so far, never on a random number,
so each step's proposal has a well-defined q: one-hot at each looked-up token, the model's warped
distribution otherwise; the verifier is told that q, so the output law is the target's
(speculative.py). Looked-up steps draw no random numbers: a seeded request stays reproducible.
The model drafter skips the looked-up steps: a draft model catches up on their tokens, an EAGLE
head on their target features, the next time it drafts (both already catch up every step).
"""

from __future__ import annotations

import torch

from ..runtime.sequence import Sequence
from .base import AutoregressiveDrafter, Drafter, Proposal, one_hot_q
from .ngram import NgramDrafter
from .tree import DraftTree


class LookupFirstDrafter(Drafter):
    def __init__(self, model_drafter: AutoregressiveDrafter, min_match: int, max_match: int | None = None):
        """model_drafter: a ModelDrafter or EagleDrafter; lookup matches the last n tokens for n
        from max(max_match, min_match) down to min_match (the longest match wins)."""
        self.model_drafter = model_drafter
        self.target_layers = model_drafter.target_layers  # what the model drafter reads, it still reads
        self.lookup = NgramDrafter(max(max_match or min_match, min_match), min_match)
        self.lookup_drafts = self.model_drafts = 0  # sequence-steps drafted by each (what bench reports)

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> Proposal:
        """Lookup's tokens for the sequences with a match, the model's for the others; q one-hot
        for looked-up tokens (None when every request is greedy: then every q is one-hot)."""
        looked_up = [self.lookup.lookup(s.tokens, n) if n > 0 else [] for s, n in zip(seqs, num_draft)]
        model = self.model_drafter.propose(seqs, [0 if found else n for found, n in zip(looked_up, num_draft)])
        self.lookup_drafts += sum(1 for found in looked_up if found)
        self.model_drafts += sum(1 for drafted in model.tokens if drafted)  # (an EAGLE head not ready yet drafts none)
        tokens = [found or drafted for found, drafted in zip(looked_up, model.tokens)]
        if all(s.params.greedy for s in seqs):
            return Proposal(tokens)
        K, V, device = max(len(d) for d in tokens), self.model_drafter.vocab_size, self.model_drafter.runner.device
        probs = torch.zeros(len(seqs), K + 1, V, device=device)  # [B, K+1, V]
        if model.probs is not None:
            width = min(K + 1, model.probs.shape[1])
            probs[:, :width] = model.probs[:, :width]  # rows of looked-up sequences are zero there
        for b, found in enumerate(looked_up):
            if found:
                probs[b, : len(found)] = one_hot_q(found, V, device)
        return Proposal(tokens, probs)

    @property
    def drafts_trees(self) -> bool:
        return self.model_drafter.drafts_trees

    def tree_slots(self, depth: int) -> int:
        return self.model_drafter.tree_slots(depth)

    def propose_trees(self, seqs: list[Sequence], max_depth: list[int]) -> list[DraftTree]:
        """In front of a tree drafter: lookup's tokens as a chain for the sequences with a match
        (any tree is exact under speculative_tree.py's rule), the drafter's trees for the others."""
        looked_up = [self.lookup.lookup(s.tokens, n) if n > 0 else [] for s, n in zip(seqs, max_depth)]
        trees = self.model_drafter.propose_trees(seqs, [0 if found else n for found, n in zip(looked_up, max_depth)])
        self.lookup_drafts += sum(1 for found in looked_up if found)
        self.model_drafts += sum(1 for t in trees if len(t))
        return [DraftTree.chain(found) if found else t for found, t in zip(looked_up, trees)]

    def observe(self, seqs: list[Sequence], starts: list[int], num_fed: list[int], hidden: torch.Tensor) -> None:
        self.model_drafter.observe(seqs, starts, num_fed, hidden)

    def rollback(self, seqs: list[Sequence]) -> None:
        self.model_drafter.rollback(seqs)

    def feed_prompt(self, seqs: list[Sequence], ends: list[int]) -> None:
        self.model_drafter.feed_prompt(seqs, ends)
