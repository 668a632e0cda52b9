"""Speculation by load: how many tokens to draft this step, from the engine's own step timings.

At batch 1 a verification of k+1 tokens costs about one decode step (the weights are read once
either way), so drafting pays; in a full batch the target's forward is compute-bound, a token
verified costs nearly what a token decoded does, and drafts the target rejects are pure loss. The
choice, for a batch of B sequences (Leviathan et al. 2023, eq. 1, with measured costs; cf. Liu et
al. 2024, "Optimizing Speculative Decoding for Serving LLMs Using Goodput"):

    k* = argmax_k  E(k) / (t(B (k+1)) + k d(B)),   E(k) = (1 - a^(k+1)) / (1 - a)

t(T): the target's forward time for T tokens fed, d(B): one draft position for B sequences, a:
the chance a draft is accepted (accepted / (accepted + steps with a rejection), as bench.py
estimates it). t and d are running means per power-of-two bucket of T and B, fed by every step the
engine runs (prefill steps too: they measure t at large T); t between measured buckets is
interpolated linearly, below the smallest taken as flat (overhead-bound), above the largest as
proportional to T (compute-bound). With nothing measured yet the full k is drafted.

Why the output stays exact: speculative sampling is exact for any k, and k is chosen before the
step's drafts, from past timings and acceptance only (the step's own tokens do not enter it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.9  # weight of the past in each running mean


def bucket(n: int) -> int:
    return max(n, 1).bit_length()


@dataclass
class RunningMeans:
    """Per bucket of x: running means of (x, y)."""

    points: dict[int, tuple[float, float]] = field(default_factory=dict)

    def add(self, x: float, y: float) -> None:
        b = bucket(int(x))
        old = self.points.get(b)
        self.points[b] = (x, y) if old is None else (DECAY * old[0] + (1 - DECAY) * x, DECAY * old[1] + (1 - DECAY) * y)

    def at(self, x: float) -> float | None:
        """y at x: interpolated between the measured buckets, flat below them, proportional above."""
        if not self.points:
            return None
        pts = sorted(self.points.values())
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9)
        return pts[-1][1] * x / pts[-1][0]


class SpeculationByLoad:
    """Chooses each step's k in 0..k_max (`choose`) and learns from each step (`observe`)."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.target = RunningMeans()  # tokens fed -> target forward seconds
        self.draft = RunningMeans()  # batch size -> seconds per draft position
        self.accepted = 1.0  # running sums for a (a prior of one acceptance in two tries)
        self.tries = 2.0
        self.last_k = k_max

    @property
    def acceptance(self) -> float:
        return min(self.accepted / self.tries, 0.999)

    def predicted_rate(self, k: int, batch: int) -> float | None:
        """Tokens per second per sequence with k drafts at this batch size (None: not measurable yet)."""
        t = self.target.at(batch * (k + 1))
        d = self.draft.at(batch) if k else 0.0
        if t is None or d is None:
            return None
        a = self.acceptance
        return (1 - a ** (k + 1)) / (1 - a) / (t + k * d)

    def choose(self, batch: int) -> int:
        rates = {k: self.predicted_rate(k, batch) for k in range(self.k_max + 1)}
        known = {k: r for k, r in rates.items() if r is not None}
        self.last_k = max(known, key=known.get) if len(known) == len(rates) else self.k_max
        return self.last_k

    def observe(self, tokens_fed: int, target_s: float, batch: int, positions: int, draft_s: float,
                accepted: int, rejections: int) -> None:
        """One step: tokens the target was fed and its time; draft positions run and their time;
        drafts accepted and sequences that saw a rejection."""
        if tokens_fed and target_s > 0:
            self.target.add(tokens_fed, target_s)
        if positions and draft_s > 0:
            self.draft.add(batch, draft_s / positions)
        self.accepted = DECAY * self.accepted + accepted
        self.tries = DECAY * self.tries + accepted + rejections
