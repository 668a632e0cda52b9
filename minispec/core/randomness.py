"""Position-keyed randomness: every random number a request uses is a function of its seed, the
absolute position of the token it helps decide, what it is for, and an index; never of how many
numbers were drawn before it.

Why. A stream of draws from a per-request generator makes a request's tokens depend on how many
draws each step took: on k, on the drafter, on what the rest of the batch did. Keyed draws remove
that dependence: the same keys give the same numbers whatever the batch, the step or the device,
and a device can compute them with no generator on the host.

The draw. u = U(key, position, purpose, step, index) in (0, 1), 52 random bits:
    key       two 32-bit lanes made from the request's 64-bit seed once (`request_key`)
    position  the absolute position (in prompt + output) of the token being decided
    purpose   `Purpose` below: what the number decides
    step      for ACCEPT and DRAFT: the position of the first token of the step that consults it
    index     a token id or a rank, else 0
Each lane absorbs the words one at a time, h <- mix(h ^ word), and each number takes one more
mix per lane of h ^ spread(index); the two lanes give the high 32 and low 20 bits. `mix` is a
two-round multiply-xorshift bijection of [0, 2^32) (the shape of Wellons' lowbias32), with odd
multipliers below 2^31, so x * c < 2^63 never overflows int64 and >> never meets a sign bit: the
same integer operations give the same numbers on Python ints, CPU tensors and CUDA tensors. A
counter-based hash, not a cryptographic one (tests/test_randomness.py checks uniformity).

One step, one use. A draft sample or an acceptance test at a position is consulted by every
step whose drafts reach that position, and a later step's k may depend on an earlier step's
outcome; reusing a number whose effect chose k would bias the rule. So DRAFT and ACCEPT are keyed
by the step too (its first position, which only grows); a TOKEN draw is consulted by the one step
that emits its position.
"""

from __future__ import annotations

import enum

import torch

MASK32 = 0xFFFFFFFF
LANES = (0x243F6A88, 0x85A308D3)  # the two lanes' starting words (digits of pi): independent streams
Key = tuple[int, int]  # a request's two 32-bit lanes


class Purpose(enum.IntEnum):
    """What a number decides (a word of its key). Extensions key their own draws from 4 up."""

    TOKEN = 1  # the draw of the token emitted at a position (inverse CDF)
    ACCEPT = 2  # the acceptance test of the draft at a position
    DRAFT = 3  # the draft sample at a position


def mix(x):
    """A bijection of [0, 2^32), for a Python int or an int64 tensor of values in [0, 2^32). (A
    tensor is copied by the first line and updated in place after it.)"""
    x = x ^ (x >> 16)
    x *= 0x21F0AAAD
    x &= MASK32
    x ^= x >> 15
    x *= 0x735A2D97
    x &= MASK32
    x ^= x >> 15
    return x


def request_key(seed: int) -> Key:
    """The two lanes of a seed in [-2^63, 2^64) (taken mod 2^64)."""
    seed %= 2**64
    low, high = seed & MASK32, seed >> 32
    return tuple(mix(mix(low ^ lane) ^ high) for lane in LANES)


def row_lanes(key: Key, position: int, purpose: int, step: int = 0) -> Key:
    """The lanes of one row of draws: the key with (position, purpose, step) absorbed."""
    lanes = []
    for h in key:
        for word in (position, int(purpose), step):
            h = mix(h ^ (word & MASK32))
        lanes.append(h)
    return tuple(lanes)


def spread(index):
    """The index word, mixed before it meets a row's lanes (int or int64 tensor in [0, 2^32))."""
    return mix(index ^ 0x9E3779B9)


def finish(lane_a, lane_b, spread_index):
    """52 random bits m -> u = (m + 1/2) / 2^52, exact in fp64 and strictly inside (0, 1) (so
    log u and log(-log u) are finite). Ints or int64 tensors (then an fp64 tensor)."""
    bits = mix(lane_a ^ spread_index)
    bits <<= 20
    bits |= mix(lane_b ^ spread_index) >> 12  # [0, 2^52)
    if isinstance(bits, torch.Tensor):
        return bits.double().add_(0.5).mul_(2.0**-52)
    return (bits + 0.5) * 2.0**-52


def uniform(key: Key, position: int, purpose: int, step: int = 0, index: int = 0) -> float:
    """One number, on the host."""
    return finish(*row_lanes(key, position, purpose, step), spread(index))
