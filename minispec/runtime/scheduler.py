"""Continuous batching: which sequences run in the next step.

Every step, running sequences keep their place, and waiting ones are admitted in arrival order
while there are free slots (`max_num_seqs`), room in the step's token budget
(`max_num_batched_tokens`) and KV pages. Without chunked prefill the budget counts the prompts
admitted in the step (one longer than all of it is admitted when nothing else runs); with it,
every token the step feeds the target (`step_feed`: the running sequences' too), so a newcomer is
admitted only while the running ones leave some of it (runtime/chunked_prefill.py splits it).
A finished sequence frees its slot and pages at once, so a waiting one joins on the very next
step. Before a step each running sequence reserves the pages the step may write (`step_tokens`:
its tokens plus the drafts it may get, in every model's pool), so a step never runs out of pages
half-way.

When a pool runs dry, the most recently admitted sequence is preempted: its pages are freed and
it goes back to the front of the queue, to be recomputed from its tokens when pages free up (its
output so far is kept, and its random numbers are keyed by position, randomness.py, so the
preemption does not change what it samples). Its drafter's state (`seq.draft_state`) goes with its pages: it described
them, and the pages the sequence gets back (recomputed, or shared from the prefix cache up to
its newest token) are others. A step that preempted admits nobody new, so freed pages go to the
survivors instead of to a newcomer that would be preempted again next step. The oldest running
sequence is never preempted by a younger one, so it always progresses and nothing livelocks.

A sequence holding pages is always in `waiting` or `running` (for a moment, in both), and leaves
them only once its pages are freed: whatever exception stops a step (a KeyboardInterrupt
included), aborting every sequence in the two lists frees every page (the LLM does).
"""

from __future__ import annotations

from collections import deque

from .kv_cache import KVPoolExhausted
from .prefix_cache import PrefixCache
from .runner import ModelRunner
from .sequence import Sequence, Status


class Scheduler:
    def __init__(
        self, runners: list[tuple[ModelRunner, str]], k: int, max_num_seqs: int, max_num_batched_tokens: int,
        tree_slots: int = 0, prefix_cache: PrefixCache | None = None, chunked_prefill: bool = False,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, "
                             f"got {max_num_seqs} and {max_num_batched_tokens}")
        row = 1 + (tree_slots or k)  # one sequence's verification: its newest token and its drafts
        if chunked_prefill and max_num_batched_tokens < row:  # (else the oldest could never step: a hang)
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one sequence's "
                             f"verification step of {row} tokens (its newest token and {row - 1} draft slots): "
                             f"raise it to {row} or more")
        self.runners = runners  # (runner, "target" | "draft"): the pools every sequence needs pages in
        self.k = k
        self.tree_slots = tree_slots  # a tree drafter's: the slots one step writes past the sequence
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0  # over the engine's life (each sequence counts its own)
        self.prefix_cache = prefix_cache  # a sequence being admitted first shares the cached pages of its prefix
        self.chunked_prefill = chunked_prefill  # a prompt past the budget is admitted while some is left: it is fed in chunks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step_tokens(self, seq: Sequence) -> int:
        """Positions the next step of seq may write: its tokens plus up to k drafts, never more
        drafts than it may still emit minus one (as `speculative_step` drafts). Over a request's
        life this never exceeds len(prompt) + max_tokens - 1: the final token is never fed.
        A tree step writes `tree_slots` past the sequence instead (when it may draft at all)."""
        if self.tree_slots:
            return len(seq) + (self.tree_slots if seq.remaining > 1 else 0)
        return len(seq) + max(0, min(self.k, seq.remaining - 1))

    def step_feed(self, seq: Sequence) -> int:
        """The most tokens the next step feeds the target for seq: its uncached tokens (a prompt,
        or a decode's newest token) plus the drafts it may get, what chunked prefill budgets."""
        return self.step_tokens(seq) - seq.target_table.num_cached

    def _reserve(self, seq: Sequence) -> bool:
        """Reserve pages for one step of seq in every pool. On failure, pages already reserved
        stay with a running seq (they are used or truncated later); a waiting seq gives them back."""
        try:
            for runner, which in self.runners:
                runner.reserve(seq.table(which), self.step_tokens(seq))
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
        seq.draft_state = None  # the drafter starts over, as with a new sequence (module docstring)
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
        budget = self.max_num_batched_tokens
        if self.chunked_prefill:  # the running sequences come first, a prompt mid-chunk with all it has left
            budget -= sum(self.step_feed(s) for s in scheduled)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (budget <= 0 if self.chunked_prefill else len(seq) > budget) and scheduled:
                break  # (without chunks, a prompt longer than the whole budget still runs, alone)
            hit = self.prefix_cache.attach(seq) if self.prefix_cache is not None else 0  # (freed again if it does not fit)
            if not self._reserve(seq):
                if not self.running:  # the engine checks at add time that this cannot happen
                    raise KVPoolExhausted(f"request {seq.request_id} does not fit in an empty KV pool")
                break
            if self.prefix_cache is not None:  # (vLLM counts tokens)
                self.prefix_cache.queries += len(seq)
                self.prefix_cache.hits += hit
                if not seq.num_preemptions:
                    seq.metrics.num_cached_tokens = hit
            self.running.append(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            scheduled.append(seq)
            budget -= self.step_feed(seq) if self.chunked_prefill else len(seq) - hit  # (a prefix cache hit is not fed)
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
