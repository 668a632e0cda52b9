"""LLMEngine: the core's engine (minispec/core/engine.py: requests in, tokens out, `step()` the
loop) with the production rooms plugged in at its named extension points:

  1. the scheduler's `Admission`: the prefix cache (runtime/prefix_cache.py) gives a sequence being
     admitted the pages already cached for its tokens;
  2. the scheduler's `StepBudget`: chunked prefill's `TokenBudget` (runtime/chunked_prefill.py)
     counts every token a step feeds the target, drafts included;
  3. the engine's step hooks (`StepFeature`, runtime/step_feature.py), in this order: speculation
     by load (runtime/speculation_by_load.py) chooses k and learns step costs, chunked prefill
     feeds prompt chunks, the prefix cache commits pages, and the metrics (runtime/metrics.py)
     stamp TTFT and finish times;
  4. the `Drafter` (drafters/base.py): every drafter of minispec/drafters/.
Three points plus the drafter, not one per feature: the scheduler's two decide who runs, the
engine's hooks what happens around a step; a feature that needs two (the prefix cache, chunked
prefill) is one object or module that plugs into both.

Beyond the hooks this class replaces two of the core's methods. `make_sequence`: a request here
is the production `Sequence` (vLLM's stop rules, text, metrics, pathwise sampling). `run_step`: the
step is the one-upload `speculative_step` of speculative.py, or `tree_step` for a tree drafter,
each timed, after `catch_up`. Preemption's one consequence for a drafter that reads the target's
features (an EAGLE head) is `catch_up`: a recomputed sequence hands its features over before it
drafts again. It stays here rather than in a hook because it is not optional: without it such a
sequence would skip a draft, which changes what a seeded request samples under the standard rule.
"""

from __future__ import annotations

import time

from .core.engine import Engine, StepOutput
from .core.scheduler import Scheduler
from .core.speculative import StepResult
from .drafters.base import Drafter, NoDrafter
from .io.tokenizer import Tokenizer
from .pathwise import PATHWISE_SAMPLING
from .runtime.chunked_prefill import ChunkedPrefill, TokenBudget, feed_chunks
from .runtime.kv_cache import BlockTable
from .runtime.metrics import RunMetrics, StepMetrics, StepTimes
from .runtime.prefix_cache import PrefixTable, prefix_cache
from .runtime.runner import ModelRunner
from .runtime.sequence import Sequence
from .runtime.speculation_by_load import SpeculationByLoad
from .runtime.step_feature import StepFeature, StepRecord
from .sampling import SamplingParams
from .speculative import speculative_step
from .speculative_tree import tree_step

__all__ = ["LLMEngine", "StepOutput"]


class LLMEngine(Engine):
    def __init__(
        self,
        target: ModelRunner,
        tokenizer: Tokenizer,
        drafter: Drafter | None = None,
        draft_runner: ModelRunner | None = None,
        num_speculative_tokens: int = 0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        seed: int | None = None,
        prefix_caching: bool = False,
        speculation_by_load: bool = False,
        chunked_prefill: bool = False,
        pathwise_sampling: str = "off",
    ):
        """k = num_speculative_tokens (0 without a drafter); draft_runner: the draft model's or
        EAGLE head's runner, whose pool every sequence also needs pages in; seed: requests without
        their own seed draw one from a generator seeded with it (else from torch's global one);
        prefix_caching: share full pages of committed K/V (runtime/prefix_cache.py; the pools'
        allocators must be CachingAllocators); speculation_by_load: each step drafts the k that its
        batch size makes pay best, from measured step costs (runtime/speculation_by_load.py; chains);
        chunked_prefill: a prompt that does not fit a step's max_num_batched_tokens is fed in chunks
        over several steps while the others decode, and the budget bounds every token a step feeds
        the target, drafts included (runtime/chunked_prefill.py); without it, the budget bounds the
        prompt tokens a step admits (core/scheduler.py); pathwise_sampling: which requests that do
        not say (SamplingParams.pathwise None) sample by Gumbel-max, so that speculation cannot change
        their tokens (pathwise.py): "off" none, "seeded" those with a seed, "on" all."""
        if pathwise_sampling not in PATHWISE_SAMPLING:
            raise ValueError(f"pathwise_sampling must be one of {PATHWISE_SAMPLING}, got {pathwise_sampling!r}")
        k = num_speculative_tokens if drafter is not None else 0
        drafter = drafter or NoDrafter()
        runners = [(target, "target")] + ([(draft_runner, "draft")] if draft_runner is not None else [])
        # A tree step writes its whole tree (and the head its fed frontiers) past the sequence.
        tree_slots = drafter.tree_slots(k) if drafter.drafts_trees else 0
        self.prefix_cache = prefix_cache(runners, drafter) if prefix_caching else None
        self.table_type = PrefixTable if prefix_caching else BlockTable
        budget = TokenBudget(max_num_batched_tokens, 1 + (tree_slots or k)) if chunked_prefill else None
        scheduler = Scheduler(runners, k, max_num_seqs, max_num_batched_tokens, extra_slots=tree_slots,
                              admission=self.prefix_cache, budget=budget)
        self.load = SpeculationByLoad(k) if speculation_by_load and k and not drafter.drafts_trees else None
        # The step's features, in the order they run: k is chosen before the chunks are planned with it.
        features = [self.load, ChunkedPrefill(max_num_batched_tokens) if chunked_prefill else None, self.prefix_cache,
                    StepMetrics()]
        super().__init__(target, drafter, draft_runner, k, max_num_seqs, max_num_batched_tokens, seed, scheduler,
                         [f for f in features if f is not None])
        self.features: list[StepFeature] = self.hooks  # (the same list)
        self.tokenizer = tokenizer
        self.times = StepTimes()  # summed over the engine's life: every step's, every chunk's and catch-up's
        self.pathwise_sampling = pathwise_sampling

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt could generate: the context's room and the
        smallest KV pool's, whole (the final token is emitted but never fed)."""
        room = self.max_model_len - prompt_len
        for runner, _ in self.runners:
            pool = runner.cache.num_pages * runner.cache.page_size
            room = min(room, pool - prompt_len + 1 - self.scheduler.extra_slots)
        return room

    def make_sequence(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(request_id, prompt_ids, params, self.target.cache.page_size, self.seed_for(params),
                       self.eos_ids, self.pathwise_for(params), self.table_type)
        seq.metrics.arrival_s = time.perf_counter()
        return seq

    def pathwise_for(self, params: SamplingParams) -> bool:
        """The request's own choice, else the engine's pathwise_sampling."""
        if params.pathwise is not None:
            return params.pathwise
        return self.pathwise_sampling == "on" or (self.pathwise_sampling == "seeded" and params.seed is not None)

    def _emit(self, seq: Sequence, token: int) -> bool:
        return seq.append(token, self.eos_ids, self.tokenizer)

    def step(self) -> list[StepOutput]:
        """The core's loop; when the hooks left nothing to run, the CUDA times of the chunks fed
        meanwhile are settled (their events are done by then)."""
        outputs = super().step()
        if not outputs:
            self.times.settle()
        return outputs

    def make_record(self, seqs: list[Sequence], k: int) -> StepRecord:
        """The step's record, taken once preempted sequences have caught up (`catch_up`)."""
        self.catch_up(seqs)
        return StepRecord(seqs, k, times=StepTimes())

    def run_step(self, record: StepRecord) -> list[StepResult]:
        step = tree_step if self.drafter.drafts_trees else speculative_step
        results = step(record.seqs, self.target, self.drafter, record.k, self._emit, record.times)
        self.times.add(record.times)  # (CUDA: the step's device times, known now that its tokens are on the host)
        return results

    def catch_up(self, seqs: list[Sequence]) -> None:
        """A drafter that reads target features drafts only for sequences whose features it has.
        A new sequence drafts nothing in its first step: its prefill emits the first token and
        hands over the prompt's features (vLLM's EAGLE flow). A preempted one (it has output
        tokens, and no K/V cached after recomputation) is fed all but its newest token here
        first, so that it drafts this very step, as it would have without the preemption (a seeded
        request then draws the same random numbers)."""
        layers = self.drafter.target_layers
        lagging = [s for s in seqs if s.output_ids and s.target_table.num_cached < len(s) - 1] if layers else []
        if lagging:  # (recomputing: prefill work, fed as one chunk each)
            chunks = {i: len(s) - 1 - s.target_table.num_cached for i, s in enumerate(lagging)}
            feed_chunks(lagging, chunks, self.target, self.drafter, self.times)

    def run_metrics(self, seqs: list[Sequence], wall_s: float, since: StepTimes | None = None) -> RunMetrics:
        """Totals over seqs; draft / target times are the engine's since `since` (a copy of
        self.times taken earlier), so they include steps of other requests run meanwhile."""
        since = since or StepTimes()
        m = RunMetrics(draft_s=self.times.draft_s - since.draft_s, target_s=self.times.target_s - since.target_s,
                       prefill_s=self.times.prefill_s - since.prefill_s,
                       prefill_steps=self.times.prefill_steps - since.prefill_steps,
                       draft_prefill_s=self.times.draft_prefill_s - since.draft_prefill_s,
                       prefill_drafted=self.times.prefill_drafted - since.prefill_drafted, wall_s=wall_s)
        for s in seqs:
            m.add(s.metrics, len(s.output_ids))
        m.num_preemptions = sum(s.num_preemptions for s in seqs)
        return m

