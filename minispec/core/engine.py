"""Engine: requests in, tokens out, one batched step at a time.

`step()` is the loop: the scheduler picks a batch (continuous batching: newly admitted prompts
and running sequences together), one `speculative_step` runs on it (plain decoding with the no-op
drafter), each sequence emits its tokens, and sequences that finished give their pages back at
once, so waiting requests join on the next step; when pages run out the scheduler preempts
(scheduler.py). A request that could never fit, even alone, is refused when it is added.

The engine's extension point is its `StepHook`s (the others: core/__init__.py). A hook may change
the step's k and who runs it, never how a token is sampled: every sequence samples from its own
inputs with its own keyed random numbers (randomness.py), so another k or another batch never
changes the law of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .drafters import Drafter, NoDrafter
from .kv_cache import KVPoolExhausted
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import StepResult, speculative_step


@dataclass
class StepRecord:
    """One step of the loop, as the hooks' `after` sees it: the sequences it ran, the drafts it
    asked for, where each sequence stood just before it, and each sequence's result."""

    seqs: list[Sequence]
    k: int
    results: list[StepResult] = field(default_factory=list)
    num_output: list[int] = field(init=False)  # per sequence, len(output_ids) before the step
    num_cached: list[int] = field(init=False)  # ... and target_table.num_cached before it

    def __post_init__(self):
        self.num_output = [len(s.output_ids) for s in self.seqs]
        self.num_cached = [s.target_table.num_cached for s in self.seqs]


class StepHook:
    """The engine's step hook: the default changes nothing before the step and does nothing after."""

    def before(self, engine: "Engine", seqs: list[Sequence], k: int) -> tuple[list[Sequence], int]:
        """The sequences that run this step and the drafts to ask for (seqs: those scheduled, or
        left by the hooks before this one, in admission order)."""
        return seqs, k

    def after(self, engine: "Engine", record: StepRecord) -> None:
        """The step ran (record); its sequences still hold their pages."""


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool
    drafted: list[int]  # the step's draft tokens for seq (empty without a drafter)
    num_accepted: int  # how many of them the target accepted: new_token_ids[:num_accepted] are drafts
    num_drafted: int = 0  # positions the step drafted


class Engine:
    def __init__(self, target: ModelRunner, drafter: Drafter | None = None, draft_runner: ModelRunner | None = None,
                 num_speculative_tokens: int = 0, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192,
                 seed: int | None = None, scheduler: Scheduler | None = None, hooks: list[StepHook] = ()):
        """k = num_speculative_tokens (0 without a drafter); draft_runner: the draft model's runner,
        whose pool every sequence also needs pages in; seed: requests without their own seed
        draw one from a generator seeded with it (else from torch's global one); scheduler: one
        built with extensions (else the plain one); hooks: run around every step, in order."""
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.k = num_speculative_tokens if drafter is not None else 0
        self.runners = [(target, "target")] + ([(draft_runner, "draft")] if draft_runner is not None else [])
        self.scheduler = scheduler or Scheduler(self.runners, self.k, max_num_seqs, max_num_batched_tokens)
        self.hooks = list(hooks)
        self.eos_ids = target.model.cfg.eos_token_ids
        self.max_model_len = target.max_positions
        self.seeds = torch.Generator().manual_seed(seed) if seed is not None else None
        self._next_id = 0

    def check_request(self, prompt_ids: list[int], params) -> None:
        """Raise ValueError if the request can never fit the context, KVPoolExhausted if it can
        never fit a KV pool even alone (queueing it would only fail later)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens fills the model's context length "
                             f"{self.max_model_len}: no room for output")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} "
                             f"exceeds the model's context length {self.max_model_len}")
        positions = total - 1 + self.scheduler.extra_slots  # the final token is never fed
        for runner, which in self.runners:
            cache = runner.cache
            need = -(-positions // cache.page_size)
            if need > cache.num_pages:
                raise KVPoolExhausted(
                    f"request needs {need} KV pages ({positions} tokens) in the {which} KV pool but the pool "
                    f"has only {cache.num_pages} pages of {cache.page_size}; raise the KV cache budget "
                    f"(kv_cache_gib) or lower max_tokens")

    def add_request(self, prompt_ids: list[int], params) -> Sequence:
        """Queue a request; it joins the running batch at the next step with room for it."""
        return self.add_requests([(prompt_ids, params)])[0]

    def add_requests(self, requests: list[tuple[list[int], object]]) -> list[Sequence]:
        """Queue several requests: all of them, or (if any is refused) none."""
        for prompt_ids, params in requests:
            self.check_request(prompt_ids, params)
        seqs = [self.make_sequence(self._next_id + i, ids, params) for i, (ids, params) in enumerate(requests)]
        self._next_id += len(seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def make_sequence(self, request_id: int, prompt_ids: list[int], params) -> Sequence:
        return Sequence(request_id, prompt_ids, params, self.target.cache.page_size, self.seed_for(params),
                        self.eos_ids)

    def seed_for(self, params) -> int:
        """The request's own seed, else one drawn from the engine's seed generator (or torch's)."""
        if params.seed is not None:
            return params.seed
        return int(torch.randint(0, 2**62, (), generator=self.seeds).item())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Run one batched step; returns what each sequence that ran emitted (finished ones have
        already given their pages back)."""
        seqs, k = self.scheduler.schedule(), self.k
        for hook in self.hooks if seqs else ():
            seqs, k = hook.before(self, seqs, k)
        if not seqs:
            return []
        record = self.make_record(seqs, k)  # (where each sequence stands before the step)
        record.results = self.run_step(record)
        for hook in self.hooks:
            hook.after(self, record)
        outputs = [StepOutput(s, s.output_ids[n:], s.finish_reason is not None, r.drafted, r.num_accepted, r.num_drafted)
                   for s, n, r in zip(seqs, record.num_output, record.results)]
        for out in outputs:
            if out.finished:
                self.scheduler.finish(out.seq)
        return outputs

    def make_record(self, seqs: list[Sequence], k: int) -> StepRecord:
        return StepRecord(seqs, k)

    def run_step(self, record: StepRecord) -> list[StepResult]:
        return speculative_step(record.seqs, self.target, self.drafter, record.k)

    def generate(self, prompts: list[list[int]], params) -> list[list[int]]:
        """Run prompts (token ids) to completion with the same params; their output ids, in order."""
        seqs = self.add_requests([(p, params) for p in prompts])
        while self.has_unfinished():
            self.step()
        return [s.output_ids for s in seqs]
