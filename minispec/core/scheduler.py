"""Continuous batching: which sequences run in the next step.

Every step, running sequences keep their place, and waiting ones are admitted in arrival order
while there are free slots (`max_num_seqs`), room in the step's token budget
(`max_num_batched_tokens`) and KV pages. The budget counts the uncached prompt tokens admitted in
the step (one prompt longer than all of it is admitted when nothing else runs). A finished
sequence frees its slot and pages at once, so a waiting one joins on the very next step. Before a
step each running sequence reserves the pages the step may write (`step_tokens`: its tokens plus
the drafts it may get, in every model's pool), so a step never runs out of pages half-way.

When a pool runs dry, the most recently admitted sequence is preempted: its pages are freed and
it goes back to the front of the queue, to be recomputed from its tokens when pages free up (its
output so far is kept, and its random numbers are keyed by position, so the preemption does not
change what it samples); `Sequence.preempted` lets it drop what described the freed pages. A
step that preempted admits nobody new, so freed pages go to the survivors instead of to a
newcomer that would be preempted again next step. The oldest running sequence is never
preempted by a younger one, so it always progresses and nothing livelocks.

Two extension points, each an object whose default here is the plain behaviour: `Admission`
(what a sequence being admitted already has cached) and `StepBudget` (how the step's token
budget is counted). A sequence holding pages is always in `waiting` or `running` (for a moment,
in both), so whatever exception stops a step, aborting every sequence in the two lists frees
every page.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .kv_cache import KVPoolExhausted
from .sequence import Sequence, Status

if TYPE_CHECKING:
    from .runner import ModelRunner


class Admission:
    """The admission hook: the default admits a sequence with nothing cached."""

    def attach(self, seq: Sequence) -> int:
        """Give seq (its tables empty) whatever K/V is already cached for its tokens; return how
        many tokens that covers (its tables' num_cached). Freed again if seq does not fit."""
        return 0

    def admitted(self, seq: Sequence, cached: int) -> None:
        """seq is admitted, `cached` of its tokens found by `attach`."""


class StepBudget:
    """The step's token budget, counted over the prompts admitted in the step: each costs its
    uncached tokens, and one that does not fit waits unless nothing else is scheduled."""

    def __init__(self, max_num_batched_tokens: int):
        self.max_num_batched_tokens = max_num_batched_tokens

    def left(self, scheduler: Scheduler, scheduled: list[Sequence]) -> int:
        """What the running sequences scheduled this step leave for newcomers."""
        return self.max_num_batched_tokens

    def fits(self, seq: Sequence, left: int) -> bool:
        return len(seq) <= left

    def cost(self, scheduler: Scheduler, seq: Sequence) -> int:
        return len(seq) - seq.target_table.num_cached  # (cached tokens are not fed)


class Scheduler:
    def __init__(self, runners: list[tuple[ModelRunner, str]], k: int, max_num_seqs: int,
                 max_num_batched_tokens: int, extra_slots: int = 0,
                 admission: Admission | None = None, budget: StepBudget | None = None):
        """runners: (runner, "target" | "draft"), the pools every sequence needs pages in (each
        runner's `.cache` is a KVCache); k: drafts per step; extra_slots: when not 0, the
        positions a step may write past the sequence's tokens in place of its k drafts (a
        drafter that writes more than its drafts in a step needs them); admission, budget: the
        extension points (module docstring), None for the defaults."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, "
                             f"got {max_num_seqs} and {max_num_batched_tokens}")
        self.runners = runners
        self.k = k
        self.extra_slots = extra_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0  # over the scheduler's life (each sequence counts its own)
        self.admission = admission or Admission()
        self.budget = budget or StepBudget(max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step_tokens(self, seq: Sequence) -> int:
        """Positions the next step of seq may write: its tokens plus up to k drafts, never more
        drafts than it may still emit minus one (as the speculative step drafts). Over a request's
        life this never exceeds len(prompt) + max_tokens - 1: the final token is never fed.
        With `extra_slots`, that many past its tokens instead (when it may draft at all)."""
        if self.extra_slots:
            return len(seq) + (self.extra_slots if seq.remaining > 1 else 0)
        return len(seq) + max(0, min(self.k, seq.remaining - 1))

    def _reserve(self, seq: Sequence) -> bool:
        """Reserve pages for one step of seq in every pool. On failure, pages already reserved
        stay with a running seq (they are used or truncated later); a waiting seq gives them
        back."""
        try:
            for runner, which in self.runners:
                seq.table(which).reserve(self.step_tokens(seq), runner.cache.allocator)
        except KVPoolExhausted:
            if seq.status is Status.WAITING:
                self._free(seq)
            return False
        return True

    def _free(self, seq: Sequence) -> None:
        for runner, which in self.runners:
            seq.table(which).free(runner.cache.allocator)

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.preempted()
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)  # victims go newest-first to the front: the oldest leads
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def schedule(self) -> list[Sequence]:
        """Pick the sequences for the next step (reserving their pages)."""
        scheduled: list[Sequence] = []
        preempted = False
        for seq in list(self.running):
            # running[-1] is at or after seq in the list (earlier ones are already scheduled), so
            # only not-yet-scheduled, younger sequences are preempted; possibly seq itself.
            while seq.status is Status.RUNNING and not self._reserve(seq):
                self._preempt(self.running[-1])
                preempted = True
            if seq.status is Status.RUNNING:
                scheduled.append(seq)
        if preempted and scheduled:
            return scheduled
        left = self.budget.left(self, scheduled)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.budget.fits(seq, left) and scheduled:
                break  # (what does not fit still runs alone)
            cached = self.admission.attach(seq)  # (freed again if it does not fit)
            if not self._reserve(seq):
                if not self.running:  # the engine checks at add time that this cannot happen
                    raise KVPoolExhausted(f"request {seq.request_id} does not fit in an "
                                          "empty KV pool")
                break
            self.admission.admitted(seq, cached)
            self.running.append(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            scheduled.append(seq)
            left -= self.budget.cost(self, seq)
        return scheduled

    def finish(self, seq: Sequence) -> None:
        """Retire seq: its slot and all its pages are free for the next step."""
        self._free(seq)
        seq.status = Status.FINISHED
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop seq wherever it is (e.g. an abandoned stream): its pages are freed."""
        self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"
