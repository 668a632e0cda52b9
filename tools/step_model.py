"""Leviathan et al.'s step model (2023, eq. 1 and Thm 3.8), with measured costs.

A chain drafts k tokens a step; the target verifies them in one forward of k+1 rows. If every draft
is accepted with the same chance a until the first rejection, a step emits on average

    E = (1 - a^(k+1)) / (1 - a)        tokens (E = k + 1 at a = 1; the bonus token included)

and costs k * t_draft + t_verify(k+1), where plain decoding pays t_decode a token, so

    speedup = E * t_decode / (k * t_draft + t_verify(k+1)).

With t_verify = t_decode and c = t_draft / t_decode this is the paper's E / (k c + 1). Measured
tokens per step can stand in for E directly (acceptance that falls with the position breaks the
closed form, not the step model); `acceptance_for` gives the a that a chain with that E has.
"""

from __future__ import annotations


def expected_tokens(a: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens a step of a k-token chain emits at per-token acceptance a."""
    if not 0 <= a <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def acceptance_for(tokens_per_step: float, k: int) -> float:
    """The a whose chain of k emits `tokens_per_step` (1 <= E <= k + 1), by bisection (E grows with a)."""
    if not 1 <= tokens_per_step <= k + 1:
        raise ValueError(f"a chain of k={k} emits 1..{k + 1} tokens a step, not {tokens_per_step}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, k) < tokens_per_step else (low, mid)
    return (low + high) / 2


def predicted_speedup(tokens_per_step: float, k: int, t_decode: float, t_draft: float, t_verify: float) -> float:
    """E * t_decode / (k * t_draft + t_verify): plain decoding's time for E tokens over one step's."""
    if min(t_decode, t_verify) <= 0 or t_draft < 0:
        raise ValueError(f"step costs must be positive (decode {t_decode}, draft {t_draft}, verify {t_verify})")
    return tokens_per_step * t_decode / (k * t_draft + t_verify)
