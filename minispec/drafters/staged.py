"""What a speculative step's drafting looks like once laid out for one upload (`Staged`, the host's
half: drafters/base.py `Drafter.stage`) and once run on the device (`Drafts`, `Drafter.run_staged`).
The verification reads both: where each sequence's drafts are, and whether the host or the device
has their tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.drafters import Proposal


@dataclass
class Staged:
    """A step's drafting laid out before anything runs (`Drafter.stage`), as the verification sees
    it: sequence b gets at most lengths[b] drafts; host_tokens[b] are the host's drafts, or
    placeholders when drawn[b] (drawn on the device: the verification reads them there). forwards:
    a model drafter's prepared forwards (active sequences, the forward, its model arguments);
    inputs: the prefix of its other arrays in the upload; proposal: a host drafter's own.
    ahead: a model drafter's catch-up pieces (prepared forward, model arguments: `feed_ahead`),
    run in order before its first forward; inner: the staging of a drafter this one stands in
    front of (drafters/lookup.py)."""

    lengths: list[int]
    host_tokens: list[list[int]]
    drawn: list[bool]
    forwards: list = field(default_factory=list)
    inputs: str = ""
    proposal: Proposal | None = None
    ahead: list = field(default_factory=list)
    inner: Staged | None = None


@dataclass
class Drafts:
    """A step's drafts on the device (`Drafter.run_staged`): tokens [B, K] int64 (target ids; row b
    valid up to num_draft[b]), num_draft [B] int64 (<= Staged.lengths: a model may stop early),
    probs [B, K+1, V] q or None (one-hot at each draft)."""

    tokens: torch.Tensor
    num_draft: torch.Tensor
    probs: torch.Tensor | None
