"""vLLM's sampling options, built on the core's warp (core/sampling.py).

The core warps logits into probabilities (temperature, top-k, top-p; greedy one-hot) for target
and draft alike, which is what keeps speculative sampling exact. Here are the options a
production API adds (n, min_tokens, stop strings and tokens, penalties, logprobs, pathwise
sampling), and a faster way to find the top-k / top-p cut-off on a CPU (`partial_sort_cutoff`, the
same cut-off as the core's sort). The penalties applied to logits before the warp are penalties.py
(one formula, on the host from token lists and on the device from counts kept there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .core import sampling as core_sampling
from .core.sampling import GREEDY_TEMPERATURE, WARP_DTYPES, WarpParams, finite_rows, sample  # noqa: F401  (re-exported)


@dataclass
class SamplingParams:
    """Per-request sampling options (vLLM's names).

    n: completions per prompt, sampled independently (completion j of a seeded request uses
    seed + j); temperature: 0 (or below 1e-5) means greedy; top_k: 0 or -1 disables; top_p in
    (0, 1]; max_tokens: new tokens to generate (vLLM's default 16; None: up to the context); min_tokens: EOS and
    stop_token_ids cannot be sampled, and stop strings do not end the request, before this many;
    stop: strings that end generation (not in the text unless include_stop_str_in_output);
    stop_token_ids: tokens that end generation (kept in token_ids, stop_reason the id);
    seed: makes the request reproducible and independent of the batch it runs in (randomness.py:
    every draw is keyed by the seed and the token's position); pathwise: sample by Gumbel-max with
    noise keyed by (seed, position), so that speculation (drafter, k, speculation by load) cannot
    change the tokens (pathwise.py; None: the LLM's pathwise_sampling decides);
    ignore_eos: keep generating past EOS (benchmarks); logprobs: also return, for every
    generated token, the target's `logprobs` most likely tokens and the sampled one with their
    log-probabilities under the model's raw distribution (log_softmax of the logits, before
    penalties, temperature, top-k and top-p; vLLM's default), e.g. soft labels for distillation.
    Penalties (vLLM's definitions, applied to the logits before the warp, at every position with
    the tokens before it, to target and draft alike; see penalties.py `penalize`): repetition_penalty (> 0, 1
    off) divides positive logits and multiplies negative ones of tokens in the prompt or output;
    presence_penalty subtracts itself from tokens in the output; frequency_penalty subtracts
    itself times the token's count in the output (both in [-2, 2], 0 off).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    pathwise: bool | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Run at construction and again when a
        request is queued, so fields changed after construction are checked too. Normalises
        stop: one string -> [string], None -> []."""

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if not (is_real(self.temperature) and 0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None (up to the context), got {self.max_tokens!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}")
        if isinstance(self.stop_token_ids, int) or self.stop_token_ids is None:
            self.stop_token_ids = [] if self.stop_token_ids is None else [self.stop_token_ids]
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if not (is_real(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (is_real(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2] (0 is off), got {getattr(self, name)!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.seed is not None and not (is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if self.pathwise is not None and not isinstance(self.pathwise, bool):
            raise ValueError(f"pathwise must be True, False or None (the LLM's pathwise_sampling), got {self.pathwise!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_TEMPERATURE (vLLM's rule too): logits / T would
        overflow or divide by an fp32 zero, and the law it tends to is the argmax's."""
        return self.temperature < GREEDY_TEMPERATURE


    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties.py `penalize` changes this request's logits (a penalty, or min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)


def warp_probs(logits: torch.Tensor, params: list[SamplingParams] | WarpParams) -> torch.Tensor:
    """The core's warp (core/sampling.py: temperature, top-k, top-p, greedy one-hot), with the
    top-k / top-p cut-off found by a partial sort on a CPU (`partial_sort_cutoff`)."""
    if not isinstance(params, WarpParams):
        params = WarpParams.of(params, logits.shape[-1], logits.device)
    cpu = logits.device.type in PARTIAL_SORT_ON and logits.shape[-1] > CANDIDATES[0]
    return core_sampling.warp_probs(logits, params, partial_sort_cutoff if cpu else core_sampling.truncation_cutoff)


CANDIDATES = (64, 1024)  # tokens sorted first, then next, when looking for the top-k / top-p cut-off
PARTIAL_SORT_ON = ("cpu",)  # device types that look among CANDIDATES first (elsewhere: one full sort, no host check)


def partial_sort_cutoff(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The core's `truncation_cutoff`, found faster on a CPU, where a full sort of a large
    vocabulary costs far more than a top-64: the cut-off is looked for among the most likely
    CANDIDATES[0] tokens first, and rows whose cut-off may lie beyond them are redone with the
    next count, the last time over the whole vocabulary by the core's sort, so the result is the
    same whichever count decides (the check is a host sync, free on a CPU)."""
    V = logits.shape[-1]
    counts = [c for c in CANDIDATES if c < V]
    cutoff, decided = truncation_cutoff(logits, top_k, top_p, counts[0])  # [N, 1], [N]
    for count in counts[1:] + [V]:
        if bool(decided.all()):
            break
        redo = (~decided).nonzero().squeeze(1)  # [R]
        if count == V:
            cutoff[redo] = core_sampling.truncation_cutoff(logits[redo], top_k[redo], top_p[redo])
            break
        cutoff[redo], decided[redo] = truncation_cutoff(logits[redo], top_k[redo], top_p[redo], count)
    return cutoff


def truncation_cutoff(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The core's cut-off (core/sampling.py `cutoff_among`), looking at the `num_candidates`
    largest logits only: logits [N, V] (temperature applied); top_k [N] in 1..V; top_p [N].
    Returns cutoff [N, 1] and decided [N]: False where the cut-off may lie past the candidates (a
    k-th most likely token beyond them, or every candidate kept by top-p: then only a call with
    num_candidates = V decides it)."""
    V = logits.shape[-1]
    cutoff, kept = core_sampling.cutoff_among(logits.topk(num_candidates, dim=-1).values, logits, top_k, top_p)
    known_kth = (top_k <= num_candidates) | (top_k >= V)  # [N]
    decided = known_kth & ~kept[:, -1] if num_candidates < V else torch.ones_like(known_kth)
    return cutoff, decided
