"""What a speculative step does with target logits that are not finite (a broken checkpoint, an
overflow): row r of a sequence's verification is used only if its first r drafts are accepted, so
the first non-finite row ends that sequence's verification there. Should the verification reach
it, the request fails where plain decoding would have met the same logits; otherwise nothing
changes. (A draft's non-finite logits only stop its proposal: drafters/base.py.)
"""

from __future__ import annotations

import torch

from .drafters.base import Proposal
from .runtime.sequence import Sequence
from .sampling import finite_rows


def guard_nonfinite(logits: torch.Tensor, proposal: Proposal, seqs: list[Sequence], greedy: bool
                    ) -> tuple[torch.Tensor, Proposal, dict[int, int], list[int] | None]:
    """Non-finite target logits (a broken checkpoint, an overflow). Row r of a sequence is used
    only if its first r drafts are all accepted, so its first non-finite row ends its verification:
    later rows and drafts are dropped. Should the verification reach that row, the request emits
    its accepted drafts and fails where plain decoding would have met the same logits; otherwise
    nothing changes (the rejection happened at a finite row). One host copy: which rows are finite
    and, when every request is greedy, their argmax. Returns (logits, proposal, {sequence b: the
    token position of its non-finite row}, the argmax per row or None)."""
    finite = finite_rows(logits)  # [sum(n_b + 1)]
    finite, best = torch.stack([finite.long(), logits.argmax(-1)]).tolist() if greedy else (finite.tolist(), None)
    num_draft = [len(d) for d in proposal.tokens]
    broken = failed_sequences(finite, num_draft)
    failures = {b: seqs[b].target_table.num_cached - num_draft[b] + r for b, r in broken.items()}  # token positions
    if broken:
        logits, proposal = cut_at_nonfinite(logits, proposal, broken)
        best = None  # rows were dropped: greedy_verify takes the argmax again
    return logits, proposal, failures, best


def failed_sequences(finite: list[bool], num_draft: list[int]) -> dict[int, int]:
    """{sequence b: its first verified row whose logits are not finite}, from `finite_rows` of the
    flat logits [sum(n_b + 1), V] on the host (empty when all are finite)."""
    broken, row = {}, 0
    for b, n in enumerate(num_draft):
        bad = [j for j in range(n + 1) if not finite[row + j]]
        if bad:
            broken[b] = bad[0]
        row += n + 1
    return broken


def cut_at_nonfinite(logits: torch.Tensor, proposal: Proposal, broken: dict[int, int]) -> tuple[torch.Tensor, Proposal]:
    """For each sequence b with first non-finite row r = broken[b]: keep its first r drafts and
    rows 0..r of the flat logits [sum(n_b + 1), V], row r zeroed (finite, so the verification
    runs; what it samples there is discarded), and zero its draft_probs [B, K+1, V] from r on."""
    keep, zero, lists, row = [], [], [], 0
    for b, drafts in enumerate(proposal.tokens):
        r = broken.get(b, len(drafts))
        if b in broken:
            zero.append(len(keep) + r)
        keep.extend(range(row, row + r + 1))
        lists.append(drafts[:r])
        row += len(drafts) + 1
    logits = logits[torch.tensor(keep, device=logits.device)]
    logits[zero] = 0.0
    draft_probs = proposal.probs
    if draft_probs is not None:
        draft_probs = draft_probs.clone()
        for b, r in broken.items():
            draft_probs[b, r:] = 0.0
    return logits, Proposal(lists, draft_probs)
