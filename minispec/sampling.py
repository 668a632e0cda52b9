"""Sampling parameters and the logits -> probabilities warp shared by target and draft.

Speculative sampling is exact only if the draft's q and the target's p are warped the same way
(temperature, then top-k, then top-p), so both go through `warp_probs`. Temperature 0 is greedy:
the warp returns a one-hot distribution at the argmax, and the rejection rule in
`speculative.py` then reduces to "accept while the draft token equals the target argmax".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request sampling options (vLLM's names).

    temperature: 0 (or below 1e-5) means greedy; top_k: 0 or -1 disables; top_p in (0, 1];
    max_tokens: new tokens to generate; stop: strings that end generation (not included in
    the text); seed: makes the request reproducible and independent of the batch it runs in;
    ignore_eos: keep generating past EOS (benchmarks); logprobs: also return, for every
    generated token, the target's `logprobs` most likely tokens and the sampled one with their
    log-probabilities under the model's raw distribution (log_softmax of the logits, before
    temperature, top-k and top-p; vLLM's default), e.g. soft labels for distillation.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

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
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.seed is not None and not (is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_TEMPERATURE (vLLM's rule too): logits / T would
        overflow or divide by an fp32 zero, and the law it tends to is the argmax's."""
        return self.temperature < GREEDY_TEMPERATURE


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily


def warp_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [N, V] fp32, one row per entry of `params` -> probabilities [N, V].

    Greedy rows become one-hot at the argmax (the lowest id among tied maxima). Others:
    softmax(logits / T), keep the top_k most likely tokens, then the smallest set of most likely
    tokens whose mass reaches top_p (the token crossing it included), renormalise. Ties are kept
    or dropped together (a token is kept iff fewer than top_k tokens, and less than top_p of the
    mass, are strictly more likely), so the result depends on the distribution only, not on
    token order or sort stability; top-k may therefore keep more than k tokens when they tie.
    """
    N, V = logits.shape
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)  # [N]
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=logits.dtype, device=device)  # [N]
    logits = logits / temp[:, None]  # [N, V]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=device)  # [N]
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)  # [N]
    if bool((top_k < V).any()) or bool((top_p < 1).any()):
        # The cut-off is found among the most likely CANDIDATES[0] tokens (a partial sort: a full
        # sort of a large vocabulary costs far more than a top-64); rows whose cut-off may
        # lie beyond them are redone with the next count, the last time over the whole
        # vocabulary, so the result is the same whichever count decides.
        counts = [c for c in CANDIDATES if c < V] + [V]
        cutoff, decided = truncation_cutoff(logits, top_k, top_p, counts[0])  # [N, 1], [N]
        for count in counts[1:]:
            if bool(decided.all()):
                break
            redo = (~decided).nonzero().squeeze(1)  # [R]
            cutoff[redo], decided[redo] = truncation_cutoff(logits[redo], top_k[redo], top_p[redo], count)
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = logits.softmax(dim=-1)  # [N, V]
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # [N, V]
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


CANDIDATES = (64, 1024)  # tokens sorted first, then next, when looking for the top-k / top-p cut-off


def truncation_cutoff(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest kept logit per row, looking at the `num_candidates` largest logits only.

    logits: [N, V] (temperature applied); top_k: [N] in 1..V; top_p: [N].
    Returns cutoff [N, 1] (keep the tokens with logit >= cutoff) and decided [N]: False where the
    cut-off may lie past the candidates (then only a call with num_candidates = V decides it).
    """
    V = logits.shape[-1]
    candidates = logits.topk(num_candidates, dim=-1).values  # [N, C], sorted descending
    # top-k: keep every token at least as likely as the k-th most likely one (top_k = V: all).
    known_kth = (top_k <= num_candidates) | (top_k >= V)  # [N]
    kth = candidates.gather(-1, (top_k.clamp(max=num_candidates) - 1)[:, None])  # [N, 1]
    kth = kth.masked_fill((top_k >= V)[:, None], float("-inf"))
    candidates = candidates.masked_fill(candidates < kth, float("-inf"))
    # top-p over the top-k survivors: normalised by all of them (beyond the candidates too).
    survivors = logits if bool((top_k >= V).all()) else logits.masked_fill(logits < kth, float("-inf"))  # [N, V]
    log_norm = survivors.logsumexp(-1, keepdim=True)  # [N, 1]
    probs = (candidates - log_norm).exp()  # [N, C]
    mass_before = probs.cumsum(-1) - probs  # [N, C]
    # The cut-off is the last surviving token whose preceding mass is < top_p (top_p = 1 keeps
    # them all: rounding must not drop a tail); keep all at least as likely.
    kept = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1)) & (candidates > float("-inf"))  # [N, C]
    kept[:, 0] = True  # the most likely token always survives (a top_p that is 0 in fp32 keeps just it)
    cutoff = candidates.gather(-1, kept.sum(-1, keepdim=True) - 1)  # [N, 1]
    decided = known_kth & ~kept[:, -1] if num_candidates < V else torch.ones_like(known_kth)
    return cutoff, decided


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] bool: the rows a distribution can be made from (no NaN, no +inf, not
    all -inf). One reduction: amax is NaN if any entry is, +inf if any is, -inf if all are."""
    return logits.amax(-1).isfinite()


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row, row i from generators[i] (None: no draw, for a row the caller
    drops). probs: [N, V] -> tokens [N] int64.

    Inverse CDF with one fp64 uniform per row: the first token whose cumulative mass exceeds
    u * total. Zero-probability tokens are never drawn (the CDF is flat there), a one-hot row
    always yields its token, and a request's draws depend only on its own generator (batch
    invariance). fp64 keeps u * total strictly below the total, so no index falls off the end.
    Rows must be distributions (callers drop non-finite logits first: see `finite_rows`); should
    one not be, the clamp still keeps the id inside the vocabulary.
    """
    u = uniforms(generators, 1, probs.device)  # [N, 1] fp64
    cdf = probs.double().cumsum(-1)  # [N, V]
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)  # [N]


def uniforms(generators: list[torch.Generator | None], n: int, device: torch.device | str) -> torch.Tensor:
    """[len(generators), n] fp64 uniforms in [0, 1), row i drawn from generators[i] only (zeros,
    drawing nothing, where it is None: a row whose result the caller drops)."""
    if not generators:
        return torch.empty(0, n, dtype=torch.float64, device=device)
    draws = [torch.zeros(n, dtype=torch.float64) if g is None else torch.rand(n, generator=g, dtype=torch.float64, device=g.device)
             for g in generators]
    return torch.stack(draws).to(device)
