"""Test helper: watch what a drafter proposes while a generate call runs."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def recording_proposals(drafter):
    """Within the block, every `drafter.propose` call is recorded, one tuple per sequence:
    (its request_id, its tokens, num_draft asked, the drafts, q rows [len(drafts) + 1, V] or None)."""
    seen = []
    original = drafter.propose

    def propose(seqs, num_draft):
        proposal = original(seqs, num_draft)
        probs = proposal.probs
        for b, (s, n, d) in enumerate(zip(seqs, num_draft, proposal.tokens)):
            seen.append((s.request_id, list(s.tokens), n, list(d), None if probs is None else probs[b, : len(d) + 1].clone()))
        return proposal

    drafter.propose = propose
    try:
        yield seen
    finally:
        del drafter.propose
