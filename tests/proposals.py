"""Test helper: watch what a drafter proposes while a generate call runs."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def recording_proposals(drafter):
    """Within the block, every proposal of `drafter` is recorded, one tuple per sequence:
    (its request_id, its tokens, num_draft asked, the drafts, q rows [len(drafts) + 1, V] or None).
    A proposal is either `propose`'s (the host loop) or a staged step's (`stage`, then the drafts
    `run_staged` made on the device; a host drafter's staged step is its `propose`)."""
    seen, asked = [], {}
    original_propose, original_stage, original_run = drafter.propose, drafter.stage, drafter.run_staged

    def record(seqs, num_draft, tokens, probs):
        for b, (s, n, d) in enumerate(zip(seqs, num_draft, tokens)):
            seen.append((s.request_id, list(s.tokens), n, list(d), None if probs is None else probs[b, : len(d) + 1].clone()))

    def propose(seqs, num_draft):
        proposal = original_propose(seqs, num_draft)
        record(seqs, num_draft, proposal.tokens, proposal.probs)
        return proposal

    def stage(seqs, num_draft, upload):
        staged = original_stage(seqs, num_draft, upload)
        asked[id(staged)] = list(num_draft)
        return staged

    def run_staged(seqs, staged, sent, penalties=None):
        drafts = original_run(seqs, staged, sent, penalties)
        if staged.proposal is None:  # (a host drafter's was recorded by propose)
            tokens = [row[:n] for row, n in zip(drafts.tokens.tolist(), drafts.num_draft.tolist())]
            record(seqs, asked.pop(id(staged)), tokens, drafts.probs)
        return drafts

    drafter.propose, drafter.stage, drafter.run_staged = propose, stage, run_staged
    try:
        yield seen
    finally:
        del drafter.propose, drafter.stage, drafter.run_staged
