"""LLMEngine: requests in, tokens out, one batched step at a time.

Each `step()` asks the scheduler for a batch (continuous batching: newly admitted prompts and
running sequences together), runs one `speculative_step` on it (plain decoding with the no-op
drafter) and returns the tokens each sequence emitted. Finished sequences give their pages back
at once, so waiting requests join on the next step; when pages run out the scheduler preempts
(see runtime/scheduler.py). A request that could never fit, even alone, is refused when it is added.

Preemption is the engine's business, and so is its one consequence for a drafter that reads the
target's features (an EAGLE head): a recomputed sequence must hand its features over before it
drafts again (`catch_up`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .drafters.base import Drafter, NoDrafter
from .io.tokenizer import Tokenizer
from .pathwise import PATHWISE_SAMPLING
from .runtime.chunked_prefill import TokenBudget, feed_chunks, plan_chunks
from .runtime.kv_cache import BlockTable, KVPoolExhausted
from .runtime.metrics import RunMetrics, StepTimes
from .runtime.prefix_cache import CachingAllocator, PrefixCache, PrefixTable
from .runtime.runner import ModelRunner
from .runtime.scheduler import Scheduler
from .runtime.speculation_by_load import SpeculationByLoad
from .runtime.sequence import Sequence
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
        prompt tokens a step admits (runtime/scheduler.py); pathwise_sampling: which requests that do
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
        self.scheduler = Scheduler(runners, self.k, max_num_seqs, max_num_batched_tokens, tree_slots, self.prefix_cache,
                                   budget)
        self.chunk_budget = max_num_batched_tokens if chunked_prefill else None
        self.eos_ids = target.model.cfg.eos_token_ids
        self.load = SpeculationByLoad(self.k) if speculation_by_load and self.k and not self.drafter.drafts_trees else None
        self.max_model_len = target.max_positions
        self.times = StepTimes()
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
        positions = total - 1 + self.scheduler.tree_slots  # the final token is never fed (Scheduler.step_tokens)
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
            room = min(room, runner.cache.num_pages * runner.cache.page_size - prompt_len + 1 - self.scheduler.tree_slots)
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
        """Run one batched step; returns what each scheduled sequence emitted (finished ones
        have already given their pages back)."""
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        k = self.load.choose(len(seqs)) if self.load is not None else self.k
        if self.chunk_budget is not None:  # what does not fit this step's budget sits it out, a prompt fed a chunk
            chunks = plan_chunks(seqs, self.chunk_budget, self.scheduler.tree_slots or k)
            if chunks:
                feed_chunks(seqs, chunks, self.target, self.drafter, self.times)
                seqs = [s for i, s in enumerate(seqs) if i not in chunks]
                if not seqs:
                    self.times.settle()
                    return []
        before = [len(s.output_ids) for s in seqs]
        self.catch_up(seqs)
        step = tree_step if self.drafter.drafts_trees else speculative_step
        fed, spent = sum(len(s) - s.target_table.num_cached for s in seqs), (self.times.target_s, self.times.draft_s)
        feeds_prompt = self.times.feeds_prompt(seqs)  # (decided before the step caches anything)
        results = step(seqs, self.target, self.drafter, k, self._emit, self.times)
        self.times.settle()  # (CUDA: the step's device times, known now that its tokens are on the host)
        if feeds_prompt:
            self.times.draft_prefill_s += self.times.draft_s - spent[1]
            self.times.prefill_drafted += sum(r.num_drafted for r in results)
        if self.load is not None:  # what this step cost, for the next one's choice
            self.load.observe(fed + sum(len(r.drafted) for r in results), self.times.target_s - spent[0], len(seqs),
                              max(r.num_drafted for r in results), self.times.draft_s - spent[1],
                              [(len(r.drafted), r.num_accepted) for r in results])
        now = time.perf_counter()  # the step's tokens are on the host: TTFT / TPOT stamps
        outputs = []
        for s, n, r in zip(seqs, before, results):
            done = s.finish_reason is not None
            if self.prefix_cache is not None and s.finish_reason != "error":
                self.prefix_cache.commit(s)  # after the step's rollback: what is cached is committed
            if n == 0 and s.output_ids:
                s.metrics.first_token_s, s.metrics.first_step_tokens = now, len(s.output_ids)
            if done:
                if s.finish_reason != "error":  # a failed request has no TPOT
                    s.metrics.finish_s = now
                self.scheduler.finish(s)
            outputs.append(StepOutput(s, s.output_ids[n:], done, r.drafted, r.num_accepted, r.num_drafted))
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


def prefix_cache(runners: list[tuple[ModelRunner, str]], drafter: Drafter) -> PrefixCache:
    """The prefix cache over the engine's pools: an EAGLE head's K/V at a position also depend on
    the next token (lookahead 1), the target's and a draft model's on the tokens up to it; with
    such a head a hit leaves the two newest tokens to feed (its features: runtime/prefix_cache.py)."""
    pools = []
    for runner, which in runners:
        if not isinstance(runner.cache.allocator, CachingAllocator):
            raise ValueError("prefix caching needs KV pools whose allocator is a CachingAllocator (KVCache(..., allocator=...))")
        pools.append((which, runner.cache.allocator, 1 if which == "draft" and drafter.target_layers else 0))
    sizes = {runner.cache.page_size for runner, _ in runners}
    if len(sizes) != 1:
        raise ValueError(f"prefix caching needs one page size in every pool, got {sorted(sizes)}")
    return PrefixCache(pools, sizes.pop(), 2 if drafter.target_layers else 1)
