"""Position-keyed randomness (minispec/randomness.py): the same numbers from the same keys on the
host and on every device, uniform, independent across positions, purposes, steps and indices,
with no int64 overflow anywhere, and a request's draws a function of its seed and positions only.

Statistics at ALPHA = 1e-3 (test_speculative_statistical.py's), fixed keys: deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from minispec.randomness import LANES, MASK32, Purpose, finish, mix, noise, request_key, row_lanes, spread, uniform, uniforms
from test_speculative_statistical import ALPHA, pooled_chi_square

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_mix_is_a_bijection_of_32_bit_words_that_never_overflows_int64():
    """Odd multipliers below 2^31: x * c < 2^63 for every 32-bit x, so int64 tensors never wrap;
    on a 2^16-word slice (all low words, and a stride through the high ones) it is one to one and
    agrees with Python's unbounded ints."""
    assert all(c < 2**31 and c % 2 for c in (0x21F0AAAD, 0x735A2D97))
    words = torch.cat([torch.arange(2**15), torch.arange(2**15) * 131071 % 2**32 + 2**31])  # [2^16]
    mixed = mix(words)
    assert mixed.min() >= 0 and mixed.max() <= MASK32
    assert len(torch.unique(mixed)) == len(words)
    assert mixed.tolist()[:50] == [mix(w) for w in words.tolist()[:50]]
    assert mix(MASK32) == mix(torch.tensor([MASK32])).item()


@pytest.mark.parametrize("device", DEVICES)
def test_host_and_device_give_the_same_numbers_bit_for_bit(device):
    """A row's numbers finished on the host (`uniform`, the standard rule's) and on a device
    (`noise`'s, vectorized over token ids) are the same fp64 values."""
    keys = [request_key(s) for s in (0, 1, -1, 2**64 - 1, -(2**63), 123456789)]
    positions = [0, 1, 7, 4095, 2**20, 3]
    ids = torch.tensor([0, 1, 2, 319, 151935], device=device)
    lanes = torch.tensor([row_lanes(k, p, Purpose.NOISE) for k, p in zip(keys, positions)], device=device)  # [6, 2]
    device_u = finish(lanes[:, :1], lanes[:, 1:], spread(ids[None, :]))  # [6, 5]
    host_u = [[uniform(k, p, Purpose.NOISE, 0, i) for i in ids.tolist()] for k, p in zip(keys, positions)]
    assert device_u.cpu().tolist() == host_u
    assert noise(keys, positions, ids).cpu().tolist() == host_u
    assert uniforms(keys, positions, Purpose.TOKEN, device).cpu().tolist() == [uniform(k, p, Purpose.TOKEN) for k, p in zip(keys, positions)]


def test_numbers_stay_strictly_inside_the_unit_interval():
    """52 bits m -> (m + 1/2) / 2^52: both extremes are exact fp64 numbers inside (0, 1), so
    log u and log(-log u) (the Gumbel noise) are finite for every key."""
    extremes = (torch.tensor([0, 2**52 - 1], dtype=torch.int64).double() + 0.5) * 2.0**-52
    assert extremes.tolist() == [2.0**-53, 1 - 2.0**-53]
    assert torch.isfinite(-torch.log(-torch.log(extremes))).all()


def test_a_seed_is_taken_mod_2_to_the_64():
    assert request_key(-1) == request_key(2**64 - 1) and request_key(0) != request_key(2**32)
    assert len({request_key(s) for s in range(10000)}) == 10000


def cells(u: torch.Tensor, bins: int) -> torch.Tensor:
    return (u * bins).long().clamp(max=bins - 1)


@pytest.mark.parametrize("purpose", list(Purpose))
def test_uniform_across_seeds_positions_and_indices(purpose):
    """40k numbers per purpose (seeds x positions x indices): chi-square over 100 equal cells
    p > ALPHA; each of the 52 bits is set half the time."""
    keys = [request_key(s) for s in range(200) for _ in range(20)]
    positions = [p for _ in range(200) for p in range(20)]
    ids = torch.arange(10)
    lanes = torch.tensor([row_lanes(k, p, purpose, 17) for k, p in zip(keys, positions)])  # [4000, 2]
    u = finish(lanes[:, :1], lanes[:, 1:], spread(ids[None, :])).flatten()  # [40000]
    counts = torch.bincount(cells(u, 100), minlength=100)
    assert pooled_chi_square(counts, torch.full((100,), 0.01))[0] > ALPHA
    bits = (u * 2.0**52 - 0.5).long()  # back to m
    ones = torch.stack([(bits >> b) & 1 for b in range(52)]).double().mean(-1)  # [52]
    assert ((ones - 0.5).abs() < 4 * 0.5 / math.sqrt(len(u))).all()


@pytest.mark.parametrize("pairing", ["next position", "other purpose", "next step", "next index", "next seed"])
def test_neighbouring_keys_give_independent_numbers(pairing):
    """Pairs of numbers whose keys differ in one word (the next position, another purpose, the
    next step, the next token id, the next seed): their joint law over a 10 x 10 grid is the
    product of uniforms (chi-square p > ALPHA, 20k pairs)."""
    a, b = [], []
    for s in range(2000):
        key, other = request_key(s), request_key(s + 1)
        for t in range(10):
            first = (key, 100 + t, Purpose.ACCEPT, 100, 0)
            second = {"next position": (key, 101 + t, Purpose.ACCEPT, 100, 0),
                      "other purpose": (key, 100 + t, Purpose.DRAFT, 100, 0),
                      "next step": (key, 100 + t, Purpose.ACCEPT, 101, 0),
                      "next index": (key, 100 + t, Purpose.ACCEPT, 100, 1),
                      "next seed": (other, 100 + t, Purpose.ACCEPT, 100, 0)}[pairing]
            a.append(uniform(*first))
            b.append(uniform(*second))
    joint = cells(torch.tensor(a), 10) * 10 + cells(torch.tensor(b), 10)
    counts = torch.bincount(joint, minlength=100)
    assert pooled_chi_square(counts, torch.full((100,), 0.01))[0] > ALPHA


def test_gumbel_noise_is_standard_gumbel():
    """G = -log(-log u): P(G <= g) = exp(-exp(-g)); chi-square over 20 cells of equal mass."""
    u = noise([request_key(s) for s in range(200)], list(range(200)), torch.arange(200)).flatten()  # [40000]
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all()
    u = torch.exp(-torch.exp(-g))  # back to uniform through the Gumbel CDF
    counts = torch.bincount(cells(u, 20), minlength=20)
    assert pooled_chi_square(counts, torch.full((20,), 0.05))[0] > ALPHA


def test_lanes_start_apart():
    assert LANES[0] != LANES[1]
    assert row_lanes(request_key(5), 3, Purpose.TOKEN)[0] != row_lanes(request_key(5), 3, Purpose.TOKEN)[1]


def test_every_draw_lands_on_the_device_asked_for():
    """A batch mixing requests with their own seed and requests drawing from the engine's seed has
    one key per row, so `uniforms` builds all its rows in one tensor on the device asked for (once
    it stacked CPU zeros with CUDA draws); `noise` follows its token ids' device. The meta device
    stands in for a GPU: any row made elsewhere would fail to join it, or land on the CPU."""
    keys = [request_key(7), request_key(2**63 + 5), request_key(0)]
    for purpose in Purpose:
        drawn = uniforms(keys, [3, 4, 5], purpose, "meta", steps=[3, 3, 3], indices=[0, 1, 2])
        assert drawn.device.type == "meta" and drawn.shape == (3,) and drawn.dtype == torch.float64
    assert uniforms(keys, [3, 4, 5], Purpose.TOKEN, "cpu").device.type == "cpu"
    ids = torch.arange(6, device="meta")
    assert noise(keys, [1, 2, 3], ids).device.type == "meta" and noise(keys, [1, 2, 3], ids).shape == (3, 6)
