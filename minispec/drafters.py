"""Drafters: who proposes the k tokens the target verifies.

ModelDrafter: a small model of the same class as the target (its own weights, config and paged
KV cache), sampling each draft token from its warped distribution q with the request's own
generator. With a confidence threshold it drafts adaptively: a sequence stops drafting after a
token the draft itself gave probability < threshold (softmax at temperature 1), so k is only an
upper bound (the dynamic draft length of HF's assisted generation). Exactness is unaffected: the
decision to stop depends only on what was already drafted (so does stopping at a draft row whose
logits are not finite, drawing no random number for it: a broken draft lowers acceptance, never
exactness). NgramDrafter: no model; it looks up the latest earlier occurrence of the sequence's
last n tokens (prompt lookup decoding, Saxena 2023) and proposes what followed; its q is one-hot.

Both implement `propose(seqs, num_draft) -> (draft_lists, draft_probs)` and `rollback(seqs)`.
"""

from __future__ import annotations

import torch

from .runner import Feed, ModelRunner
from .sampling import finite_rows, sample, warp_probs
from .sequence import Sequence


class ModelDrafter:
    def __init__(self, runner: ModelRunner, confidence_threshold: float | None = None, vocab_size: int | None = None):
        """vocab_size: the target's, when the draft's embedding is padded to another size (the
        same tokenizer: the rows past the real vocabulary are never real tokens). q then lives
        on the target's vocabulary: extra draft columns are dropped, missing ones get q = 0."""
        if confidence_threshold is not None and not 0 < confidence_threshold < 1:
            raise ValueError(f"draft confidence_threshold must be in (0, 1), got {confidence_threshold}")
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self.vocab_size = vocab_size or runner.model.cfg.vocab_size

    def logits(self, feeds: list[Feed]) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits on the target's vocabulary [n, V] (non-finite rows zeroed) and which rows are usable."""
        logits = self.runner.forward(feeds)  # [n, V_draft]
        V, Vd = self.vocab_size, logits.shape[-1]
        if Vd > V:
            logits = logits[:, :V]
        elif Vd < V:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], V - Vd), float("-inf"))], dim=-1)
        return drop_nonfinite(logits)

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Run num_draft[b] autoregressive draft steps for each sequence b.

        Returns draft token lists and draft_probs [B, K+1, V] (K = max(num_draft)), row b holding
        q_1..q_n at positions < num_draft[b] and zeros after; None when every request is greedy
        (q is then one-hot at each drafted token). The first step also catches up on
        tokens the draft has not cached yet (the whole prompt at first, then 1 or 2 tokens).
        With a confidence threshold, row b stops early after a token x with softmax(logits)[x] < it.
        """
        # The draft's own context: the i-th draft token is sampled after feeding position len(s) - 2 + i.
        num_draft = [max(0, min(n, self.runner.max_positions - len(s) + 1)) for s, n in zip(seqs, num_draft)]
        B, K, V = len(seqs), max(num_draft), self.vocab_size
        if K == 0:
            return [[] for _ in seqs], None
        # Greedy requests draft the argmax: q is one-hot there, which the verifier assumes of a
        # None draft_probs, so an all-greedy batch needs no warp, sampling or [B, K+1, V] tensor.
        greedy = all(s.params.greedy for s in seqs)
        draft_lists: list[list[int]] = [[] for _ in seqs]
        draft_probs = None if greedy else torch.zeros(B, K + 1, V, device=self.runner.device)  # [B, K+1, V]
        active = [b for b in range(B) if num_draft[b] > 0]
        feeds = {b: seqs[b].tokens[seqs[b].draft.num_cached :] for b in active}
        for i in range(K):
            logits, ok = self.logits([Feed(seqs[b].draft, feeds[b]) for b in active])  # [len(active), V], [len(active)]
            if greedy:
                sampled = logits.argmax(-1)  # [len(active)]
            else:  # unusable rows draw no random number, so the host needs `ok` before sampling
                q = warp_probs(logits, [seqs[b].params for b in active])  # [len(active), V]
                sampled = sample(q, [seqs[b].generator if u else None for b, u in zip(active, ok.tolist())])
            confident = None
            if self.confidence_threshold is not None:
                own = logits.float().softmax(-1).gather(-1, sampled[:, None]).squeeze(-1)  # [len(active)]
                confident = own >= self.confidence_threshold
            sampled, usable, confident = to_host(sampled, ok, confident)
            for row, (b, t) in enumerate(zip(active, sampled)):
                if usable[row]:
                    draft_lists[b].append(t)
                    if not greedy:
                        draft_probs[b, i] = q[row]
                    feeds[b] = [t]
            active = [b for b, c, u in zip(active, confident, usable) if c and u and num_draft[b] > i + 1]
            if not active:
                break
        return draft_lists, draft_probs

    def rollback(self, seqs: list[Sequence]) -> None:
        """Forget draft K/V past the accepted tokens (the newest token is fed next step)."""
        for s in seqs:
            s.draft.truncate(len(s) - 1, self.runner.cache.allocator)


def drop_nonfinite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft whose logits are not finite proposes nothing from that row on (it can only lower
    acceptance; the target's verification keeps the output exact). Returns the logits with such
    rows zeroed (so warping and sampling them stays in range; the caller drops what they give)
    and which rows are usable. logits: [n, V] -> ([n, V], [n] bool), no host copy."""
    ok = finite_rows(logits)  # [n]
    return torch.where(ok[:, None], logits, 0.0), ok


def to_host(sampled: torch.Tensor, ok: torch.Tensor, confident: torch.Tensor | None) -> tuple[list[int], list[bool], list[bool]]:
    """One host copy per draft step: the drafted ids [n], which rows are usable [n] and which are
    confident enough to go on drafting [n] (all, without a threshold)."""
    host = torch.stack([sampled, ok.long()] + ([confident.long()] if confident is not None else [])).tolist()
    return host[0], [bool(x) for x in host[1]], [bool(x) for x in host[2]] if confident is not None else [True] * len(host[0])


class NgramDrafter:
    """Prompt-lookup drafting: match the last n tokens (n from max_n down to min_n) against the
    sequence's earlier tokens; propose the up-to-k tokens that followed the latest match."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> tuple[list[list[int]], None]:
        return [self.lookup(s.tokens, n) if n > 0 else [] for s, n in zip(seqs, num_draft)], None

    def rollback(self, seqs: list[Sequence]) -> None:
        pass
