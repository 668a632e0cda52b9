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

In a step laid out ahead (`stage` / `run_staged`, speculative.py), lookup decides on the host and
its tokens ride up in the step's one upload; the model drafter is staged for the other sequences
and draws on the device; the two are joined there, q included (one-hot rows scattered from the
uploaded tokens), so the step still makes one upload and one download.
"""

from __future__ import annotations

import torch

from ..runtime.sequence import Sequence
from ..runtime.transfers import Upload
from ..core.speculative import one_hot_q
from ..penalties import Penalties
from .base import AutoregressiveDrafter, Drafter, Drafts, Proposal, Staged
from .draft_tree import DraftTree
from .ngram import NgramDrafter


class LookupFirstDrafter(Drafter):
    def __init__(self, model_drafter: AutoregressiveDrafter, min_match: int, max_match: int | None = None):
        """model_drafter: a ModelDrafter or EagleDrafter; lookup matches the last n tokens for n
        from max(max_match, min_match) down to min_match (the longest match wins)."""
        self.model_drafter = model_drafter
        self.target_layers = model_drafter.target_layers  # what the model drafter reads, it still reads
        self.lookup = NgramDrafter(max(max_match or min_match, min_match), min_match)
        # Sequence-steps drafted by each (what bench reports). A staged step counts the sequences the
        # model was staged for (before the device knows whether a non-finite row stops one at 0).
        self.lookup_drafts = self.model_drafts = 0

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

    def stage(self, seqs: list[Sequence], num_draft: list[int], upload: Upload) -> Staged:
        """`propose`'s choice, laid out: lookup's tokens ride up ([B, K] and their counts [B]); the
        model drafter is staged for the sequences lookup found nothing for (0 drafts for the others)."""
        looked_up = [self.lookup.lookup(s.tokens, n) if n > 0 else [] for s, n in zip(seqs, num_draft)]
        model = self.model_drafter.stage(seqs, [0 if found else n for found, n in zip(looked_up, num_draft)], upload)
        self.lookup_drafts += sum(1 for found in looked_up if found)
        self.model_drafts += sum(1 for n in model.lengths if n > 0)
        lengths = [len(found) or n for found, n in zip(looked_up, model.lengths)]
        K, prefix = max(lengths, default=0), upload.scope()
        upload.add(prefix + "tokens", [found + [0] * (K - len(found)) for found in looked_up])  # [B, K]
        upload.add(prefix + "num_draft", [len(found) for found in looked_up])  # [B]
        host_tokens = [found or placeholders for found, placeholders in zip(looked_up, model.host_tokens)]
        return Staged(lengths, host_tokens, model.drawn, inputs=prefix, inner=model)

    def run_staged(self, seqs: list[Sequence], staged: Staged, sent: dict[str, torch.Tensor],
                   penalties: Penalties | None = None) -> Drafts:
        """The model drafter's drafts on the device, joined with lookup's from the upload: row b
        holds lookup's tokens where it found some, the model's otherwise; q (unless every request
        is greedy) is one-hot at each looked-up token and the model's q elsewhere, as `propose`'s."""
        model = self.model_drafter.run_staged(seqs, staged.inner, sent, penalties)
        looked_up, num_looked_up = sent[staged.inputs + "tokens"], sent[staged.inputs + "num_draft"]  # [B, K], [B]
        B, K = looked_up.shape
        from_lookup = torch.arange(K, device=looked_up.device)[None, :] < num_looked_up[:, None]  # [B, K]
        model_tokens = torch.nn.functional.pad(model.tokens, (0, K - model.tokens.shape[1]))  # [B, K]
        tokens = torch.where(from_lookup, looked_up, model_tokens)  # [B, K]
        num_draft = num_looked_up + model.num_draft  # [B] (one of the two is 0)
        if all(s.params.greedy for s in seqs):  # every q is one-hot
            return Drafts(tokens, num_draft, None)
        V = self.model_drafter.vocab_size
        probs = torch.zeros(B, K + 1, V, device=looked_up.device)  # [B, K+1, V]
        if model.probs is not None:  # (None: the model drafted for no sequence)
            width = min(K + 1, model.probs.shape[1])  # (a host loop that stopped early leaves zero rows past K)
            probs[:, :width] = model.probs[:, :width]  # zero in looked-up rows and past the model's drafts
        one_hot = one_hot_q(looked_up.flatten(), V, looked_up.device).view(B, K, V)  # [B, K, V]
        probs[:, :K] += one_hot * from_lookup[..., None]
        return Drafts(tokens, num_draft, probs)

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

    def stage_trees(self, seqs: list[Sequence], max_depth: list[int], upload: Upload):
        """`propose_trees`' choice, laid out: the tree drafter's search is staged for the sequences
        lookup found nothing for, and lookup's chains are host trees of the others (None where
        the tree drafter searches on the host)."""
        looked_up = [self.lookup.lookup(s.tokens, n) if n > 0 else [] for s, n in zip(seqs, max_depth)]
        rest = [0 if found else n for found, n in zip(looked_up, max_depth)]  # the drafter's
        staged = self.model_drafter.stage_trees(seqs, rest, upload)
        if staged is None:
            return None  # (propose_trees looks up again: the same chains)
        self.lookup_drafts += sum(1 for found in looked_up if found)
        self.model_drafts += sum(1 for n in staged.sizes if n > 0)
        for b, found in enumerate(looked_up):
            if found:
                staged.host_trees[b], staged.sizes[b] = DraftTree.chain(found), len(found)
        return staged

    def run_staged_trees(self, seqs: list[Sequence], staged, sent: dict[str, torch.Tensor]):
        return self.model_drafter.run_staged_trees(seqs, staged, sent)

    def observe(self, seqs: list[Sequence], starts: list[int], num_fed: list[int], hidden: torch.Tensor) -> None:
        self.model_drafter.observe(seqs, starts, num_fed, hidden)

    def rollback(self, seqs: list[Sequence]) -> None:
        self.model_drafter.rollback(seqs)

    def feed_prompt(self, seqs: list[Sequence], ends: list[int]) -> None:
        self.model_drafter.feed_prompt(seqs, ends)
