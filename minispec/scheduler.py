"""Continuous batching: which sequences run in the next step.

Every step, running sequences keep their place, and waiting ones are admitted in arrival order
while there are free slots (`max_num_seqs`), room in the prefill token budget
(`max_num_batched_tokens`) and KV pages. Before a step each running sequence reserves the pages
the step may write (its uncached tokens plus k drafts, in every model's pool). When a pool runs
dry, the most recently admitted sequence is preempted: its pages are freed and it goes back to
the front of the queue, to be recomputed from its tokens when pages free up (its output so far is
kept, and its random generator carries on, so the preemption does not change what it samples).
"""

from __future__ import annotations

from collections import deque

from .kv_cache import KVPoolExhausted
from .runner import ModelRunner
from .sequence import Sequence, Status


class Scheduler:
    def __init__(
        self, runners: list[tuple[ModelRunner, str]], k: int, max_num_seqs: int, max_num_batched_tokens: int
    ):
        self.runners = runners  # (runner, "target" | "draft"): the pools every sequence needs pages in
        self.k = k
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, seq: Sequence) -> bool:
        """Reserve pages for one step of seq in every pool. On failure, pages already reserved
        stay with seq (they are used or truncated later); a waiting seq gives them back."""
        try:
            for runner, which in self.runners:
                runner.reserve(getattr(seq, which), len(seq) + self.k)
        except KVPoolExhausted:
            if seq.status is Status.WAITING:
                self._free(seq)
            return False
        return True

    def _free(self, seq: Sequence) -> None:
        for runner, which in self.runners:
            getattr(seq, which).free(runner.cache.allocator)

    def schedule(self) -> list[Sequence]:
        """Pick the sequences for the next step (reserving their pages)."""
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            while seq in self.running and not self._reserve(seq):
                victim = self.running[-1]  # newest first; possibly seq itself
                self.running.remove(victim)
                self._free(victim)
                victim.status = Status.WAITING
                self.waiting.appendleft(victim)
                self.num_preemptions += 1
            if seq in self.running:
                scheduled.append(seq)
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if len(seq) > budget and scheduled:
                break
            if not self._reserve(seq):
                if not self.running:
                    raise KVPoolExhausted(f"request {seq.request_id} does not fit in an empty KV pool")
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
            budget -= len(seq)
        return scheduled

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self._free(seq)
