"""Sampling parameters and the logits -> probabilities warp that target and draft share.

Speculative sampling is exact only if the draft's q and the target's p are warped the same way
(temperature, then top-k, then top-p), so both go through `warp_probs`. Temperature 0 is greedy:
the warp returns a one-hot distribution at the argmax, and the rejection rule (speculative.py)
then reduces to "accept while the draft token equals the target argmax".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (logits / T would overflow)


@dataclass
class SamplingParams:
    """temperature: 0 (below 1e-5) is greedy; top_k: 0 or -1 keeps all; top_p in (0, 1];
    max_tokens: new tokens to generate; seed: keys every random number the request uses
    (randomness.py), so its tokens do not depend on the batch it runs in."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (self.top_k >= 1 or self.top_k in (0, -1)):
            raise ValueError(f"top_k must be >= 1, or 0 / -1 to keep all tokens, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


WARP_DTYPES = {"temperature": torch.float64, "top_k": torch.int64, "top_p": torch.float64, "greedy": torch.bool}


@dataclass
class WarpParams:
    """Each row's warp parameters as device tensors [N], and two facts the host knows about them
    without asking the device (so a step never waits on it)."""

    temperature: torch.Tensor  # [N] fp64, 1 on greedy rows
    top_k: torch.Tensor  # [N] int64 in 1..V (V: no top-k)
    top_p: torch.Tensor  # [N] fp64 in (0, 1]
    greedy: torch.Tensor  # [N] bool
    truncates: bool  # some row has a top-k or a top-p
    any_greedy: bool

    @classmethod
    def arrays(cls, params: list, vocab_size: int) -> dict[str, list]:
        """Each row's parameters as host lists, named as the fields (dtypes: WARP_DTYPES), from
        SamplingParams-like objects (temperature, top_k, top_p, greedy), one per row."""
        return {"temperature": [1.0 if p.greedy else p.temperature for p in params],
                "top_k": [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                "top_p": [p.top_p for p in params], "greedy": [p.greedy for p in params]}

    @classmethod
    def of(cls, params: list, vocab_size: int, device: torch.device | str | None,
           on_device: dict[str, torch.Tensor] | None = None) -> "WarpParams":
        """From `arrays`, copied to `device` now, or already there in `on_device` (the same names)."""
        if on_device is None:
            on_device = {name: torch.tensor(values, dtype=WARP_DTYPES[name], device=device)
                         for name, values in cls.arrays(params, vocab_size).items()}
        return cls(**on_device, truncates=any(0 < p.top_k < vocab_size or p.top_p < 1 for p in params),
                   any_greedy=any(p.greedy for p in params))


def truncation_cutoff(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest kept logit per row: logits [N, V] (temperature applied), top_k [N] in 1..V,
    top_p [N] -> cutoff [N, 1] (keep the tokens with logit >= cutoff), from one full sort."""
    return cutoff_among(logits.sort(dim=-1, descending=True).values, logits, top_k, top_p)[0]


def cutoff_among(ranked: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut-off as found among ranked [N, C], the C <= V largest logits of each row sorted
    descending: a token survives top-k if it is at least as likely as the k-th (top_k = V: all);
    among the survivors (normalised over all of them, past the C too), top-p keeps each token whose
    preceding mass is < top_p, and the most likely always. Returns (cutoff [N, 1], kept [N, C])."""
    V, C = logits.shape[-1], ranked.shape[-1]
    kth = ranked.gather(-1, (top_k.clamp(max=C) - 1)[:, None])  # [N, 1]
    kth = kth.masked_fill((top_k >= V)[:, None], float("-inf"))
    ranked = ranked.masked_fill(ranked < kth, float("-inf"))  # the top-k survivors
    log_norm = logits.masked_fill(logits < kth, float("-inf")).logsumexp(-1, keepdim=True)  # [N, 1]
    probs = (ranked - log_norm).exp()  # [N, C]
    mass_before = probs.cumsum(-1) - probs  # [N, C]
    kept = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1)) & (ranked > float("-inf"))  # [N, C]
    kept[:, 0].fill_(True)  # (fill_, not "= True": writing a Python scalar into a slice is a copy to the device)
    return ranked.gather(-1, kept.sum(-1, keepdim=True) - 1), kept  # [N, 1], [N, C]


Cutoff = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def warp_probs(logits: torch.Tensor, params: list | WarpParams, cutoff: Cutoff = truncation_cutoff) -> torch.Tensor:
    """logits: [N, V] fp32, one row per entry of `params` -> probabilities [N, V].

    Greedy rows become one-hot at the argmax (the lowest id among tied maxima). Others:
    softmax(logits / T) over the tokens that survive top-k then top-p (`truncation_cutoff`). Ties
    are kept or dropped together, so the result depends on the distribution only, never on token
    order or sort stability. cutoff: another way to find the same cut-off may plug in."""
    if not isinstance(params, WarpParams):
        params = WarpParams.of(params, logits.shape[-1], logits.device)
    logits = logits / params.temperature.to(logits.dtype)[:, None]  # [N, V]
    if params.truncates:
        kept = cutoff(logits, params.top_k, params.top_p.to(logits.dtype))  # [N, 1]
        logits = logits.masked_fill(logits < kept, float("-inf"))
    probs = logits.softmax(dim=-1)  # [N, V]
    if params.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # [N, V]
        probs = torch.where(params.greedy[:, None], one_hot, probs)
    return probs


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] bool: the rows a distribution can be made from (no NaN, no +inf, not
    all -inf). One reduction: amax is NaN if any entry is, +inf if any is, -inf if all are."""
    return logits.amax(-1).isfinite()


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF: probs [N, V], u [N] fp64 keyed uniforms in (0, 1) ->
    tokens [N] int64, the first token whose cumulative mass exceeds u * total. Zero-probability
    tokens are never drawn, a one-hot row always yields its token, and a row's token depends on
    its own row and uniform only. fp64 keeps u * total strictly below the total."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    threshold = u.to(device=probs.device, dtype=torch.float64)[:, None] * cdf[:, -1:]  # [N, 1]
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)  # [N]
