"""The engine's extension point: a feature that runs before and after each step of the loop.

`LLMEngine.step` is the loop: the scheduler picks a batch, one speculative (or tree) step runs on
it, and each sequence emits its tokens or finishes. A `StepFeature` is an object with two methods,
both no-ops (the core's `StepHook`, minispec/core/engine.py):

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

from dataclasses import dataclass

from ..core import engine as core


@dataclass
class StepRecord(core.StepRecord):
    """The core's record of a step (the sequences it ran, where each stood just before it ran,
    each one's result) and the step's own costs: its drafting and verification only, not the
    chunks or catch-ups before it."""

    times: "StepTimes" = None  # runtime/metrics.py (which imports this module); the engine gives one

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


class StepFeature(core.StepHook):
    """The engine's step hook, as the production rooms implement it: the default changes nothing
    before the step and does nothing after."""
