"""LLMEngine: requests in, tokens out, one batched step at a time.

`step()` is the loop: the scheduler picks a batch (continuous batching: newly admitted prompts and
running sequences together), the step's features run before it, one `speculative_step` (or
`tree_step`) runs on the batch (plain decoding with the no-op drafter), the features run after
it, and sequences that finished give their pages back at once, so waiting requests join on the
next step; when pages run out the scheduler preempts (see core/scheduler.py). A request that
could never fit, even alone, is refused when it is added.

Production features plug in from outside, through three named extension points, each an object
whose default is the plain behaviour:
  1. the scheduler's `Admission`: what a sequence being admitted already has cached
     (prefix caching: runtime/prefix_cache.py);
  2. the scheduler's `StepBudget`: how a step's token budget is counted (chunked prefill:
     runtime/chunked_prefill.py);
  3. the engine's `StepFeature` (runtime/step_feature.py): `before` a step it may change k or take
     sequences out of the step, `after` it it sees what the step did (a `StepRecord`) while the
     sequences still hold their pages. Speculation by load (runtime/speculation_by_load.py) chooses
     k and learns step costs, chunked prefill feeds prompt chunks, the prefix cache commits pages,
     and the metrics (runtime/metrics.py) stamp TTFT and finish times.
Drafters plug into the step itself, through the `Drafter` interface (drafters/base.py). Three
points, not one per feature: the scheduler's two decide who runs, the engine's one what happens
around a step; a feature that needs two (the prefix cache, chunked prefill) is one object or
module that plugs into both.

Preemption is the engine's business, and so is its one consequence for a drafter that reads the
target's features (an EAGLE head): a recomputed sequence must hand its features over before it
drafts again (`catch_up`). It stays in the loop rather than in a feature because it is not
optional: without it such a sequence would skip a draft, which changes what a seeded request
samples under the standard rule; it is guarded by the drafter interface's own `target_layers`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .drafters.base import Drafter, NoDrafter
from .io.tokenizer import Tokenizer
from .pathwise import PATHWISE_SAMPLING
from .runtime.chunked_prefill import ChunkedPrefill, TokenBudget, feed_chunks
from .runtime.kv_cache import BlockTable, KVPoolExhausted
from .runtime.metrics import RunMetrics, StepMetrics, StepTimes
from .runtime.prefix_cache import PrefixTable, prefix_cache
from .runtime.runner import ModelRunner
from .core.scheduler import Scheduler
from .runtime.speculation_by_load import SpeculationByLoad
from .runtime.sequence import Sequence
from .runtime.step_feature import StepFeature, StepRecord
from .sampling import SamplingParams
from .speculative import speculative_step
from .speculative_tree import tree_step


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool
    drafted: list[int]  # the step's draft tokens for seq (empty without a drafter)
    num_accepted: int  # how many of them the target accepted: new_token_ids[:num_accepted] are drafts
    num_drafted: int = 0  # positions the step drafted: len(drafted) for a chain, the depth of a tree


class LLMEngine:
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
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter or NoDrafter()
        self.k = num_speculative_tokens if drafter is not None else 0
        runners = [(target, "target")] + ([(draft_runner, "draft")] if draft_runner is not None else [])
        self.runners = runners
        # A tree step writes its whole tree (and the head its fed frontiers) past the sequence.
        tree_slots = self.drafter.tree_slots(self.k) if self.drafter.drafts_trees else 0
        self.prefix_cache = prefix_cache(runners, self.drafter) if prefix_caching else None
        self.table_type = PrefixTable if prefix_caching else BlockTable
        budget = TokenBudget(max_num_batched_tokens, 1 + (tree_slots or self.k)) if chunked_prefill else None
        self.scheduler = Scheduler(runners, self.k, max_num_seqs, max_num_batched_tokens, extra_slots=tree_slots,
                                   admission=self.prefix_cache, budget=budget)
        self.load = SpeculationByLoad(self.k) if speculation_by_load and self.k and not self.drafter.drafts_trees else None
        # The step's features, in the order they run: k is chosen before the chunks are planned with it.
        features = [self.load, ChunkedPrefill(max_num_batched_tokens) if chunked_prefill else None, self.prefix_cache,
                    StepMetrics()]
        self.features: list[StepFeature] = [f for f in features if f is not None]
        self.eos_ids = target.model.cfg.eos_token_ids
        self.max_model_len = target.max_positions
        self.times = StepTimes()  # summed over the engine's life: every step's, every chunk's and catch-up's
        self.seeds = torch.Generator().manual_seed(seed) if seed is not None else None
        if pathwise_sampling not in PATHWISE_SAMPLING:
            raise ValueError(f"pathwise_sampling must be one of {PATHWISE_SAMPLING}, got {pathwise_sampling!r}")
        self.pathwise_sampling = pathwise_sampling
        self._next_id = 0

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never fit the context, KVPoolExhausted if it can
        never fit a KV pool even alone (queueing it would only fail later)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens fills the model's context length {self.max_model_len}: "
                             "no room for output")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} "
                f"exceeds the model's context length {self.max_model_len}"
            )
        positions = total - 1 + self.scheduler.extra_slots  # the final token is never fed (Scheduler.step_tokens)
        for runner, which in self.runners:
            cache = runner.cache
            need = -(-positions // cache.page_size)
            if need > cache.num_pages:
                raise KVPoolExhausted(
                    f"request needs {need} KV pages ({positions} tokens) in the {which} KV pool but the pool "
                    f"has only {cache.num_pages} pages of {cache.page_size}; raise the KV cache budget "
                    f"(kv_cache_gib) or lower max_tokens"
                )

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt could generate: the context's room and the
        smallest KV pool's, whole (the final token is emitted but never fed)."""
        room = self.max_model_len - prompt_len
        for runner, _ in self.runners:
            room = min(room, runner.cache.num_pages * runner.cache.page_size - prompt_len + 1 - self.scheduler.extra_slots)
        return room

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; it joins the running batch at the next step with room for it.
        Raises (before queueing anything) as `check_request` does."""
        return self.add_requests([(prompt_ids, params)])[0]

    def add_requests(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Sequence]:
        """Queue several requests: all of them, or (if any is refused) none."""
        for prompt_ids, params in requests:
            self.check_request(prompt_ids, params)
        seqs = [Sequence(self._next_id + i, ids, params, self.target.cache.page_size, self.seed_for(params), self.eos_ids,
                         self.pathwise_for(params), self.table_type) for i, (ids, params) in enumerate(requests)]
        self._next_id += len(seqs)
        now = time.perf_counter()
        for seq in seqs:
            seq.metrics.arrival_s = now
            self.scheduler.add(seq)
        return seqs

    def seed_for(self, params: SamplingParams) -> int:
        """The request's own seed, else one drawn from the engine's seed generator (or torch's)."""
        if params.seed is not None:
            return params.seed
        return int(torch.randint(0, 2**62, (), generator=self.seeds).item())

    def pathwise_for(self, params: SamplingParams) -> bool:
        """The request's own choice, else the engine's pathwise_sampling."""
        if params.pathwise is not None:
            return params.pathwise
        return self.pathwise_sampling == "on" or (self.pathwise_sampling == "seeded" and params.seed is not None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _emit(self, seq: Sequence, token: int) -> bool:
        return seq.append(token, self.eos_ids, self.tokenizer)

    def step(self) -> list[StepOutput]:
        """Run one batched step; returns what each sequence that ran emitted (finished ones have
        already given their pages back)."""
        seqs, k = self.scheduler.schedule(), self.k
        if not seqs:
            return []
        for feature in self.features:  # k by load; prompts too long for the budget fed a chunk, sitting out
            seqs, k = feature.before(self, seqs, k)
        if not seqs:
            self.times.settle()
            return []
        self.catch_up(seqs)
        record = StepRecord(seqs, k, StepTimes())  # (where each sequence stands before the step)
        step = tree_step if self.drafter.drafts_trees else speculative_step
        record.results = step(seqs, self.target, self.drafter, k, self._emit, record.times)
        self.times.add(record.times)  # (CUDA: the step's device times, known now that its tokens are on the host)
        for feature in self.features:  # commit cached pages, stamp times, learn the step's costs
            feature.after(self, record)
        outputs = [StepOutput(s, s.output_ids[n:], s.finish_reason is not None, r.drafted, r.num_accepted, r.num_drafted)
                   for s, n, r in zip(seqs, record.num_output, record.results)]
        for out in outputs:
            if out.finished:
                self.scheduler.finish(out.seq)
        return outputs

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

