"""Speculation by load: how many tokens to draft this step, from the engine's own step timings.

At batch 1 a verification of k+1 tokens costs about one decode step (the weights are read once
either way), so drafting pays; in a full batch the target's forward is compute-bound, a token
verified costs nearly what a token decoded does, and drafts the target rejects are pure loss. The
choice, for a batch of B sequences (Leviathan et al. 2023, eq. 1, with measured costs; cf. Liu et
al. 2024, "Optimizing Speculative Decoding for Serving LLMs Using Goodput"):

    k* = argmax_k  E(k) / (t(B (k+1)) + k d(B)),   E(k) = 1 + sum_{j=1..k} a_1 a_2 ... a_j

t(T): the target's forward time for T tokens fed, d(B): one draft position for B sequences, a_j:
the chance that draft j is accepted when drafts 1..j-1 were, counted depth by depth. One rate a
for every depth (E = (1 - a^(k+1)) / (1 - a)) would assume that each draft is accepted as often
as the first; it is not: a deeper draft is drawn from the draft's own guesses, and acceptance
comes in runs (an easy stretch accepts all), so each depth has its own rate. t and d are medians
of the last few steps per power-of-two bucket of T and B, fed by every step the engine runs
(prefill steps too: they measure t at large T); t between measured buckets is interpolated
linearly, below the smallest taken as flat (overhead-bound), above the largest as proportional
to T (compute-bound). With nothing measured yet the full k is drafted; a depth not drafted
lately keeps its last rate.

How it plugs in: `SpeculationByLoad` is a `StepFeature` (runtime/step_feature.py): its `before`
chooses the step's k for the batch scheduled, its `after` observes what the step cost (the step's
own times, not those of the prompt chunks or catch-ups fed before it) and what it accepted.

Why the output stays exact: speculative sampling is exact for any k, and k is chosen before the
step's drafts, from past timings and acceptance only (the step's own tokens do not enter it).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from .sequence import Sequence
from .step_feature import StepFeature, StepRecord

DECAY = 0.9  # weight of the past in the acceptance counts
WINDOW = 9  # steps per bucket whose median times are used


def bucket(n: int) -> int:
    return max(n, 1).bit_length()


@dataclass
class RecentMedians:
    """Per bucket of x: the (low) medians of x and of y over its last WINDOW points. A median, not
    a mean: a step far off (the first of its shape, a preemption's recompute, a stall of the
    machine) hardly moves it; the low one, so that of two points a slow outlier is not taken."""

    points: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)
    _medians: list[tuple[float, float]] | None = field(default=None, init=False, repr=False, compare=False)

    def add(self, x: float, y: float) -> None:
        self.points.setdefault(bucket(int(x)), deque(maxlen=WINDOW)).append((x, y))
        self._medians = None

    def medians(self) -> list[tuple[float, float]]:
        """(median x, median y) of each bucket, in order of x."""
        if self._medians is None:
            self._medians = sorted((statistics.median_low(x for x, _ in d), statistics.median_low(y for _, y in d))
                                   for d in self.points.values())
        return self._medians

    def at(self, x: float) -> float | None:
        """y at x: interpolated between the measured buckets, flat below them, proportional above."""
        pts = self.medians()
        if not pts:
            return None
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9)
        return pts[-1][1] * x / pts[-1][0]


class SpeculationByLoad(StepFeature):
    """Chooses each step's k in 0..k_max (`choose`) and learns from each step (`observe`); as the
    engine's step feature, before and after each step (chains only: see `observe`)."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.target = RecentMedians()  # tokens fed -> target forward seconds
        self.draft = RecentMedians()  # batch size -> seconds per draft position
        # Per depth j = 1..k_max, decayed counts (a prior of one acceptance in two tries):
        # reached_j <- DECAY reached_j + #{n >= j, a >= j - 1},  passed_j <- DECAY passed_j + #{a >= j}
        # over the step's sequences (n drafted, a accepted), and a_j = passed_j / reached_j.
        self.reached = [2.0] * k_max
        self.passed = [1.0] * k_max
        self.last_k = k_max

    def before(self, engine, seqs: list[Sequence], k: int) -> tuple[list[Sequence], int]:
        return seqs, self.choose(len(seqs))

    def after(self, engine, record: StepRecord) -> None:
        results = record.results
        self.observe(record.num_fed, record.times.target_s, len(record.seqs), max(r.num_drafted for r in results),
                     record.times.draft_s, [(len(r.drafted), r.num_accepted) for r in results])

    def acceptance(self, j: int) -> float:
        """a_j for depth j = 1..k_max."""
        return min(self.passed[j - 1] / self.reached[j - 1], 0.999)

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum_{j=1..k} a_1 ... a_j: the tokens a step emits per sequence with k drafts
        (the drafts accepted, and the target's own token after them)."""
        expected, run = 1.0, 1.0
        for j in range(1, k + 1):
            run *= self.acceptance(j)
            expected += run
        return expected

    def predicted_rate(self, k: int, batch: int) -> float | None:
        """Tokens per second per sequence with k drafts at this batch size (None: not measurable yet)."""
        t = self.target.at(batch * (k + 1))
        d = self.draft.at(batch) if k else 0.0
        if t is None or d is None:
            return None
        return self.expected_tokens(k) / (t + k * d)

    def choose(self, batch: int) -> int:
        rates = {k: self.predicted_rate(k, batch) for k in range(self.k_max + 1)}
        known = {k: r for k, r in rates.items() if r is not None}
        self.last_k = max(known, key=known.get) if len(known) == len(rates) else self.k_max
        return self.last_k

    def observe(self, tokens_fed: int, target_s: float, batch: int, positions: int, draft_s: float,
                verdicts: list[tuple[int, int]]) -> None:
        """One step: tokens the target was fed and its time; draft positions run and their time;
        per sequence, (n drafted, a accepted; a <= n). For chains: a tree's accepted path is not a
        prefix of what it drafted."""
        if tokens_fed and target_s > 0:
            self.target.add(tokens_fed, target_s)
        if positions and draft_s > 0:
            self.draft.add(batch, draft_s / positions)
        for j in range(self.k_max):  # depth j + 1: drafted (n > j) after drafts 1..j were all accepted (a >= j)
            reached = sum(n > j and a >= j for n, a in verdicts)
            if reached:
                self.reached[j] = DECAY * self.reached[j] + reached
                self.passed[j] = DECAY * self.passed[j] + sum(a > j for _, a in verdicts)
