"""Speculative-decoding metrics, per request and per run.

acceptance rate            = accepted draft tokens / drafted tokens (vLLM's)
mean accepted per step     = tokens emitted per target forward = 1 + accepted / steps, over EVERY
                             target step (vLLM's mean acceptance length divides by the steps that
                             drafted; the server's /metrics reports that one)
per-position acceptance[i] = steps whose i-th draft was accepted / steps that drafted an i-th token
                             (vLLM divides by the steps that drafted at all: the same at a fixed k)
A tree step counts its depth as drafted and its accepted path as accepted (speculative_tree.py).
TTFT (time to first token) = first token's time - the request's arrival (queueing and prefill)
TPOT (time per output token) = (finish - first token) / (tokens emitted after the step that
                             emitted the first): the decode speed a request sees, which speculation
                             changes and prefill does not. For plain decoding that step emits one
                             token and this is vLLM's (tokens - 1); a speculative first step (the
                             prompt verified together with k drafts) can emit several, and their
                             time is in the TTFT, so they are not counted again here. (An EAGLE
                             head drafts from the second step: its first step is a plain prefill,
                             and its catch-up over the prompt is in the TPOT.)

How the stamps and counts plug in: `StepMetrics` is the engine's `StepFeature`
(runtime/step_feature.py); after each step it stamps the first token and the finish of the
step's sequences, and counts the verification and drafting of steps that fed a prompt (StepTimes). The per-request
counts are recorded by the step itself (`RequestMetrics.record`), its times into a `StepTimes`.
Why the output stays exact: these only read the clock and what the step did; nothing they write
is read by the step.

The counts are the rejection sampler's decisions. In a request's last step, EOS, a stop string or
max_tokens may cut the accepted run short, so tokens emitted can be fewer than accepted + 1 there.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .step_feature import StepFeature, StepRecord


@dataclass
class RequestMetrics:
    """Counters for one request. `accepted_per_position[i]` counts steps whose i-th draft token was
    accepted; `drafted_per_position[i]` counts steps that drafted an i-th token."""

    num_steps: int = 0  # target forward passes
    num_drafted: int = 0
    num_accepted: int = 0
    num_rejected: int = 0  # steps in which the target rejected a draft (accepted < drafted)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    arrival_s: float | None = None  # time.perf_counter() when the request was added
    first_token_s: float | None = None  # ... when the step emitting its first token ended
    first_step_tokens: int = 1  # tokens that step emitted (more than 1 where it was speculative)
    finish_s: float | None = None  # ... when the step finishing it ended
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (vLLM's)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_rejected += num_accepted < num_drafted
        for counts, n in ((self.drafted_per_position, num_drafted), (self.accepted_per_position, num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens emitted per target forward pass: 1 + accepted/steps (the +1 is the recovered or bonus token)."""
        return 1 + self.num_accepted / self.num_steps if self.num_steps else 0.0

    def ttft_s(self) -> float | None:
        """Time to first token (None before it)."""
        if self.arrival_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s

    def tpot_s(self, num_generated: int) -> float | None:
        """Time per output token after the first step, over a finished request's num_generated
        tokens (None before it finished, or when the first step emitted them all)."""
        after = num_generated - self.first_step_tokens
        if self.first_token_s is None or self.finish_s is None or after < 1:
            return None
        return (self.finish_s - self.first_token_s) / after


@dataclass
class RunMetrics(RequestMetrics):
    """Totals over the requests of one `generate` call, plus timings (the per-request time stamps
    it inherits stay unset: a run has sums of TTFT and TPOT instead)."""

    num_requests: int = 0
    num_generated: int = 0  # tokens emitted
    num_preemptions: int = 0
    draft_s: float = 0.0  # time in the drafter (proposals, catch-up)
    target_s: float = 0.0  # time in target verification and rejection sampling
    prefill_s: float = 0.0  # the part of target_s in steps that fed some request its prompt (and in catch-ups)
    prefill_steps: int = 0  # the request-steps of those steps (every request in them)
    draft_prefill_s: float = 0.0  # the part of draft_s in those steps (a draft model prefills the prompt there too)
    prefill_drafted: int = 0  # the tokens drafted in those steps
    wall_s: float = 0.0
    ttft_sum_s: float = 0.0  # over the requests that have a TTFT ...
    num_ttft: int = 0
    tpot_sum_s: float = 0.0  # ... and over those that have a TPOT (vLLM's mean: per request, then averaged)
    num_tpot: int = 0

    def add(self, r: RequestMetrics, num_generated: int) -> None:
        """Count one request in."""
        self._add_counts(r)
        self.num_requests += 1
        self.num_generated += num_generated
        ttft, tpot = r.ttft_s(), r.tpot_s(num_generated)
        if ttft is not None:
            self.ttft_sum_s, self.num_ttft = self.ttft_sum_s + ttft, self.num_ttft + 1
        if tpot is not None:
            self.tpot_sum_s, self.num_tpot = self.tpot_sum_s + tpot, self.num_tpot + 1

    def merge(self, other: "RunMetrics") -> None:
        """Add another run's totals in (bench.py sums its rounds so)."""
        self._add_counts(other)
        for name in ("num_requests", "num_generated", "num_preemptions", "draft_s", "target_s", "prefill_s", "prefill_steps",
                     "draft_prefill_s", "prefill_drafted", "wall_s",
                     "ttft_sum_s", "num_ttft", "tpot_sum_s", "num_tpot"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def _add_counts(self, r: RequestMetrics) -> None:
        self.num_steps += r.num_steps
        self.num_drafted += r.num_drafted
        self.num_accepted += r.num_accepted
        self.num_rejected += r.num_rejected
        for mine, theirs in ((self.drafted_per_position, r.drafted_per_position), (self.accepted_per_position, r.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def per_position_acceptance(self) -> list[float]:
        accepted = self.accepted_per_position + [0] * (len(self.drafted_per_position) - len(self.accepted_per_position))
        return [a / d if d else 0.0 for a, d in zip(accepted, self.drafted_per_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.wall_s if self.wall_s else 0.0

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_sum_s / self.num_ttft if self.num_ttft else None

    @property
    def mean_tpot_s(self) -> float | None:
        return self.tpot_sum_s / self.num_tpot if self.num_tpot else None

    def summary(self) -> dict:
        return {
            "requests": self.num_requests,
            "generated_tokens": self.num_generated,
            "target_steps": self.num_steps,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_per_step": round(self.mean_accepted_per_step, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "tokens_per_s": round(self.tokens_per_s, 2),
            "mean_ttft_ms": None if self.mean_ttft_s is None else round(self.mean_ttft_s * 1e3, 2),
            "mean_tpot_ms": None if self.mean_tpot_s is None else round(self.mean_tpot_s * 1e3, 2),
            "draft_s": round(self.draft_s, 4),
            "target_s": round(self.target_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "wall_s": round(self.wall_s, 4),
            "preemptions": self.num_preemptions,
        }


@dataclass
class StepTimes:
    """Seconds spent drafting and in the target (verification), summed over steps; prefill_s:
    the part of target_s spent feeding prompts (steps that fed some sequence its prompt, and the
    catch-up of preempted sequences), prefill_steps: the request-steps of those steps. A decode
    step's cost is (target_s - prefill_s) over the other request-steps. draft_prefill_s and
    prefill_drafted: the drafting time and drafted tokens of those steps, so that a drafted
    token's cost, (draft_s - draft_prefill_s) / (drafted - prefill_drafted), leaves out a draft
    model's prefill of the prompt (a cost of the first token, not of drafting)."""

    draft_s: float = 0.0
    target_s: float = 0.0
    prefill_s: float = 0.0
    prefill_steps: int = 0
    draft_prefill_s: float = 0.0
    prefill_drafted: int = 0
    pending: list = field(default_factory=list, repr=False, compare=False)  # CUDA blocks not yet added (`settle`)

    @contextmanager
    def verifying(self, seqs: list, device: torch.device):
        """Time one step's verification into target_s. Whether the step fed a prompt (its time
        then counts into prefill_s too) is decided after it, by `StepMetrics`, from where its
        sequences stood before it: by the time the verification runs, the runner may already count
        the step's tokens as cached."""
        with self.timing("target_s", device):
            yield

    @contextmanager
    def timing(self, part: str, device: torch.device, also: str | None = None):
        """Add the block's time to `part` ("draft_s" or "target_s"), and to `also` if given. On a
        CPU: its wall time. On CUDA: the device time between two events recorded around it, added
        by `settle` once the step has waited for its results anyway (waiting here would stall
        the device between drafting and verification)."""
        names = (part, also) if also else (part,)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((names, start, end))
            return
        start_s = time.perf_counter()
        yield
        for name in names:
            setattr(self, name, getattr(self, name) + time.perf_counter() - start_s)

    def add(self, step: "StepTimes") -> None:
        """Add one step's times in (settling both: the step's tokens are on the host by now)."""
        self.settle()
        step.settle()
        for name in ("draft_s", "target_s", "prefill_s", "prefill_steps", "draft_prefill_s", "prefill_drafted"):
            setattr(self, name, getattr(self, name) + getattr(step, name))

    def settle(self) -> None:
        """Add the CUDA blocks timed so far (see `timing`; their events are done by now)."""
        for names, start, end in self.pending:
            end.synchronize()
            for name in names:
                setattr(self, name, getattr(self, name) + start.elapsed_time(end) / 1e3)
        self.pending.clear()


class StepMetrics(StepFeature):
    """After each step: TTFT and finish stamps, and the drafting of steps that fed a prompt."""

    def after(self, engine, record: StepRecord) -> None:
        now = time.perf_counter()  # the step's tokens are on the host
        for seq, n in zip(record.seqs, record.num_output):
            if n == 0 and seq.output_ids:
                seq.metrics.first_token_s, seq.metrics.first_step_tokens = now, len(seq.output_ids)
            if seq.finish_reason is not None and seq.finish_reason != "error":  # (a failed request has no TPOT)
                seq.metrics.finish_s = now
        if record.feeds_prompt:  # its verification prefilled a prompt, a draft model's drafting too: a cost
            times = engine.times  # of the first token, which bench's decode and draft costs leave out
            times.prefill_s += record.times.target_s
            times.prefill_steps += len(record.seqs)
            times.draft_prefill_s += record.times.draft_s
            times.prefill_drafted += sum(r.num_drafted for r in record.results)
