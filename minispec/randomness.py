"""Position-keyed randomness, as the extensions use it.

The hash, the request key and one number per row are the core's (minispec/core/randomness.py,
which says why every draw is keyed by seed and position). Here are the two purposes only the
extensions use, with the values after the core's: a tree walk's BRANCH tests (speculative_tree.py)
and pathwise sampling's NOISE (pathwise.py), a number per token of the vocabulary whose last mix
runs on the device, vectorized over the vocabulary (`noise`). Pathwise noise is shared by every
step and every drafter by design: there the emitted token is a fixed function of the noise,
whatever k is. The BRANCH draws are keyed by the step, as the core's ACCEPT and DRAFT are.
"""

from __future__ import annotations

import enum

import torch

from .core.randomness import LANES, MASK32, Key, finish, mix, request_key, row_lanes, spread, uniform

__all__ = ["LANES", "MASK32", "Key", "Purpose", "finish", "mix", "noise", "request_key", "row_lanes", "spread", "uniform", "uniforms"]


class Purpose(enum.IntEnum):
    """What a number decides (a word of its key): the core's three, then the extensions'."""

    TOKEN = 1  # the standard rule's draw of the token emitted at a position (inverse CDF)
    ACCEPT = 2  # the standard rule's acceptance test of the draft at a position
    DRAFT = 3  # the standard rule's draft sample at a position
    BRANCH = 4  # a tree walk's test of a child at a position (index: its rank among its siblings)
    NOISE = 5  # pathwise sampling's Gumbel noise at a position (index: the token id), shared by target and drafts


def uniforms(keys: list[Key], positions: list[int], purpose: int, device: torch.device | str,
             steps: list[int] | None = None, indices: list[int] | None = None) -> torch.Tensor:
    """One number per row, computed on the host: [N] fp64 on `device`."""
    steps = steps or [0] * len(keys)
    indices = indices or [0] * len(keys)
    values = [uniform(k, p, purpose, s, i) for k, p, s, i in zip(keys, positions, steps, indices)]
    return torch.tensor(values, dtype=torch.float64, device=device)


def noise(keys: list[Key], positions: list[int], token_ids: torch.Tensor) -> torch.Tensor:
    """Pathwise sampling's uniforms u[r, j] = U(keys[r], positions[r], NOISE, index=token_ids[j])
    (its Gumbel noise is -log(-log u)), independent across tokens and positions. token_ids: int64
    token ids, [M] for every row (the vocabulary, a draft's columns) or [N, M] per row, on the
    device the noise is wanted on. Returns [N, M] fp64 in (0, 1)."""
    lanes = torch.tensor([row_lanes(k, p, Purpose.NOISE) for k, p in zip(keys, positions)], dtype=torch.int64,
                         device=token_ids.device).view(-1, 2)  # [N, 2]
    ids = token_ids if token_ids.dim() == 2 else token_ids[None, :]  # [N or 1, M]
    return finish(lanes[:, :1], lanes[:, 1:], spread(ids))  # [N, M]
