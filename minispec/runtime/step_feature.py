"""The engine's extension point: a feature that runs before and after each step of the loop.

`LLMEngine.step` is the loop: the scheduler picks a batch, one speculative (or tree) step runs on
it, and each sequence emits its tokens or finishes. A `StepFeature` is an object with two methods,
both no-ops here:

  * `before(engine, seqs, k) -> (seqs, k)`: runs once the batch is scheduled, before the step. It
    may choose another k (speculation by load) or take sequences out of this step, feeding them
    something else instead (chunked prefill feeds a prompt a chunk and lets it sit the step out).
  * `after(engine, record)`: runs once the step's tokens are on the host, while its sequences
    still hold their pages (the engine retires finished ones after every feature's `after`):
    commit pages to a cache, stamp times, learn from what the step cost.

The engine runs its features in list order, `before` and `after` alike; a feature that needs
another's choice comes after it (chunked prefill plans with the k speculation by load chose).
The engine is passed in, as the scheduler passes itself to a `StepBudget`: a feature reads what
it needs (the target runner, the drafter, the engine's times) when it runs, not a copy taken
when it was built.

What a feature may change is the step's k and who runs it, never how a token is sampled: the
step samples each sequence's tokens from its own inputs and its own random stream, keyed by
position (randomness.py), so another k or another batch changes neither the distribution of a
sequence's tokens nor, with pathwise sampling, the tokens themselves. Each feature's module says
why it keeps the output exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Types are named in quotes and not imported: the engine, the step, the sequence and its metrics
# all import this module (the metrics subclass it), so an import back would be a cycle.


@dataclass
class StepRecord:
    """One step of the loop, as the features' `after` sees it: the sequences it ran, where each
    stood just before it ran (its outputs so far, its target-cached tokens), the step's own
    costs, and each sequence's result."""

    seqs: "list[Sequence]"
    k: int  # the drafts the step asked for (per sequence, never more than it may still emit)
    times: "StepTimes"  # this step's drafting and verification only (not the chunks or catch-ups before it)
    results: "list[StepResult]" = field(default_factory=list)
    num_output: list[int] = field(init=False)  # per sequence, len(output_ids) before the step
    num_cached: list[int] = field(init=False)  # ... and target_table.num_cached before it

    def __post_init__(self):
        self.num_output = [len(s.output_ids) for s in self.seqs]
        self.num_cached = [s.target_table.num_cached for s in self.seqs]

    @property
    def feeds_prompt(self) -> bool:
        """Whether the step fed some sequence its prompt (nothing of it cached before)."""
        return any(c == 0 for c in self.num_cached)

    @property
    def num_fed(self) -> int:
        """Tokens the step's verification fed the target: each sequence's uncached tokens (a
        prompt, or the newest token) and its drafts."""
        uncached = sum(len(s.prompt_ids) + n - c for s, n, c in zip(self.seqs, self.num_output, self.num_cached))
        return uncached + sum(len(r.drafted) for r in self.results)


class StepFeature:
    """The engine's step hook: the default changes nothing before the step and does nothing after."""

    def before(self, engine: "LLMEngine", seqs: "list[Sequence]", k: int) -> "tuple[list[Sequence], int]":
        """The sequences that run this step and the drafts to ask for; seqs: those scheduled (or
        left by the features before this one), in admission order."""
        return seqs, k

    def after(self, engine: "LLMEngine", record: StepRecord) -> None:
        """The step ran (record); its sequences still hold their pages."""
