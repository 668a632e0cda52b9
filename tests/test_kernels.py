"""The Triton kernels agree with their torch twins, and the twins with naive float64 attention.

Without CUDA the kernels run under the Triton interpreter, which is slow and computes bf16
`tl.dot` wrongly: CPU cases use fp32 and fp16 and small shapes (sequences up to 40 tokens),
bf16 cases are marked slow and need a GPU. Tiles of 16 make these short sequences span several
query and key tiles, so the online softmax, the tile skipping and the masking at tile edges are
all exercised.

Tolerances (max abs difference to the reference): fp32 1e-5; fp16 2e-3 absolute plus 2e-3
relative (outputs are averages of N(0, 1) values: a few units, where one fp16 ulp is 2e-3).
"""

import math
from itertools import accumulate

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# Importing a kernel module selects Triton's interpreter when there is no CUDA (kernels/_triton.py).
from minispec.kernels._checks import should_validate
from minispec.kernels.flash_prefill import flash_prefill, flash_prefill_ref
from minispec.kernels.kv_write import write_kv, write_kv_ref
from minispec.kernels.paged_attention import paged_attention, paged_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


# --------------------------------------------------------------------------- batch builders


def naive_attention(q, k, v, query_pos, *, sm_scale, sliding_window):
    """One sequence, one (query head, kv head) pair at a time, float64 softmax over allowed keys.

    q [Lq, Hq, D]; k, v [Lk, Hkv, D]; query i sits at position query_pos[i] and sees key j iff
    j <= query_pos[i] and query_pos[i] - j < sliding_window. Returns [Lq, Hq, D] float64.
    """
    num_queries, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)  # [Lq, Hq, D]
    for head in range(num_q_heads):
        kv_head = head // group
        for i in range(num_queries):
            pos = int(query_pos[i])
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys = k[lo:pos + 1, kv_head].double()  # [n, D]
            values = v[lo:pos + 1, kv_head].double()  # [n, D]
            weights = torch.softmax(keys @ q[i, head].double() * sm_scale, dim=0)  # [n]
            out[i, head] = weights @ values
    return out


def packed_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, dtype, seed):
    """Random q [T, Hq, D], k, v [T, Hkv, D] and cu_seqlens [B+1] int32 for the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(seq_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    cu_seqlens = torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_seqlens.to(DEVICE)


class PagedBatch:
    """Sequences whose K/V live in shuffled pages of a pool, with NaN in every unused slot.

    Each sequence gets ceil(seq_len / page_size) pages drawn at random from a pool with
    `spare_pages` extra pages, so block tables are non-contiguous and garbage (NaN) surrounds
    the real data: a kernel that reads a slot it should not turns its output into NaN.
    Keeps the dense per-sequence K/V for the naive check.
    """

    def __init__(self, seq_lens, q_lens, *, page_size, num_q_heads, num_kv_heads, head_dim,
                 dtype, seed, spare_pages=3, extra_columns=1):
        gen = torch.Generator().manual_seed(seed)
        pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
        num_pages = sum(pages_per_seq) + spare_pages
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"), dtype=dtype)  # [P, page_size, Hkv, D]
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
        block_tables = torch.full((len(seq_lens), max(pages_per_seq) + extra_columns), -1, dtype=torch.int32)
        page_order = torch.randperm(num_pages, generator=gen).tolist()
        self.dense_k, self.dense_v = [], []
        for seq, (seq_len, n_pages) in enumerate(zip(seq_lens, pages_per_seq)):
            k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)  # [L, Hkv, D]
            v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            for pos in range(seq_len):
                page = page_order[sum(pages_per_seq[:seq]) + pos // page_size]
                k_cache[page, pos % page_size] = k[pos]
                v_cache[page, pos % page_size] = v[pos]
            block_tables[seq, :n_pages] = torch.tensor(
                page_order[sum(pages_per_seq[:seq]):sum(pages_per_seq[:seq + 1])], dtype=torch.int32)
            self.dense_k.append(k)
            self.dense_v.append(v)
        self.q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        self.k_cache, self.v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
        self.block_tables = block_tables.to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.query_start_loc = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
        self.q_lens = list(q_lens)
        self.max_query_len, self.max_seq_len = max(q_lens), max(seq_lens)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.max_query_len, self.max_seq_len)

    def naive(self, *, sm_scale, sliding_window):
        out = []
        starts = self.query_start_loc.tolist()
        for seq, (k, v) in enumerate(zip(self.dense_k, self.dense_v)):
            seq_len, q_len = len(k), self.q_lens[seq]
            positions = torch.arange(seq_len - q_len, seq_len)
            out.append(naive_attention(self.q[starts[seq]:starts[seq + 1]].cpu(), k, v, positions,
                                       sm_scale=sm_scale, sliding_window=sliding_window))
        return torch.cat(out)


# --------------------------------------------------------------------------- strategies

head_shapes = st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([16, 32, 64]))
windows = st.one_of(st.none(), st.just(1), st.integers(2, 8), st.just(64))
cpu_dtypes = st.sampled_from([torch.float32, torch.float16])
seeds = st.integers(0, 2**31 - 1)


@st.composite
def seq_and_query_lens(draw, max_seqs=3, max_len=40):
    """(seq_lens, q_lens): decode (1), verification (<= 5), whole prompt, or any chunk per sequence."""
    seq_lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs))
    q_lens = [draw(st.one_of(st.just(1), st.integers(1, min(5, n)), st.just(n), st.integers(1, n)))
              for n in seq_lens]
    return seq_lens, q_lens


# --------------------------------------------------------------------------- flash_prefill


@settings(max_examples=20, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), heads=head_shapes,
       window=windows, dtype=cpu_dtypes, tiles=st.sampled_from([(16, 16), (16, 32), (None, None)]), seed=seeds)
def test_flash_prefill_matches_reference(seq_lens, heads, window, dtype, tiles, seed):
    """Each packed sequence attends causally to itself only, whatever the tiling and GQA ratio."""
    num_kv_heads, group, head_dim = heads
    q, k, v, cu_seqlens = packed_batch(seq_lens, num_kv_heads * group, num_kv_heads, head_dim, dtype, seed)
    kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window)
    out = flash_prefill(q, k, v, cu_seqlens, max(seq_lens), **kwargs, block_m=tiles[0], block_n=tiles[1])
    assert_close(out, flash_prefill_ref(q, k, v, cu_seqlens, max(seq_lens), **kwargs), dtype)


@settings(max_examples=30, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 24), min_size=1, max_size=3), heads=head_shapes,
       window=windows, seed=seeds)
def test_flash_prefill_ref_matches_naive_float64(seq_lens, heads, window, seed):
    """The reference itself is right: per (sequence, head) float64 softmax over j <= i, i - j < W."""
    num_kv_heads, group, head_dim = heads
    q, k, v, cu_seqlens = packed_batch(seq_lens, num_kv_heads * group, num_kv_heads, head_dim, torch.float32, seed)
    out = flash_prefill_ref(q, k, v, cu_seqlens, max(seq_lens), sm_scale=0.3, sliding_window=window)
    bounds = cu_seqlens.tolist()
    expected = torch.cat([
        naive_attention(q[a:b].cpu(), k[a:b].cpu(), v[a:b].cpu(), torch.arange(b - a), sm_scale=0.3,
                        sliding_window=window)
        for a, b in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_flash_prefill_window_of_one_returns_own_value():
    """W = 1 lets each token see only itself, so the output is its own value row (GQA-mapped)."""
    q, k, v, cu_seqlens = packed_batch([5, 19], 4, 2, 32, torch.float32, seed=0)
    out = flash_prefill(q, k, v, cu_seqlens, 19, sm_scale=0.125, sliding_window=1, block_m=16, block_n=16)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_flash_prefill_large_head_dims(head_dim):
    """The larger supported head dims (default tiles) match the reference."""
    q, k, v, cu_seqlens = packed_batch([3, 20], 2, 1, head_dim, torch.float16, seed=1)
    out = flash_prefill(q, k, v, cu_seqlens, 20, sm_scale=head_dim**-0.5)
    assert_close(out, flash_prefill_ref(q, k, v, cu_seqlens, 20, sm_scale=head_dim**-0.5), torch.float16)


# --------------------------------------------------------------------------- paged_attention


@settings(max_examples=30, deadline=None)
@given(lens=seq_and_query_lens(), page_size=st.sampled_from([4, 8, 16]), heads=head_shapes,
       window=windows, dtype=cpu_dtypes, num_splits=st.sampled_from([1, 2, 3]),
       block_m=st.sampled_from([16, None]), spare_pages=st.integers(0, 4), seed=seeds)
def test_paged_attention_matches_reference(lens, page_size, heads, window, dtype, num_splits, block_m,
                                           spare_pages, seed):
    """Decode, verification and prefill chunks of different lengths in one launch, over shuffled
    pages surrounded by NaN, agree with the reference for every page size, GQA ratio and split."""
    (seq_lens, q_lens), (num_kv_heads, group, head_dim) = lens, heads
    batch = PagedBatch(seq_lens, q_lens, page_size=page_size, num_q_heads=num_kv_heads * group,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed,
                       spare_pages=spare_pages)
    kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window)
    out = paged_attention(*batch.args(), **kwargs, num_splits=num_splits, block_m=block_m, block_n=16)
    assert_close(out, paged_attention_ref(*batch.args(), **kwargs), dtype)


@settings(max_examples=30, deadline=None)
@given(lens=seq_and_query_lens(max_len=24), page_size=st.sampled_from([1, 4, 8, 16]), heads=head_shapes,
       window=windows, seed=seeds)
def test_paged_attention_ref_matches_naive_float64(lens, page_size, heads, window, seed):
    """The paged reference is right: new token i of sequence b sits at seq_len - q_len + i and sees
    exactly the cached keys j <= its position within the window (float64, per sequence and head)."""
    (seq_lens, q_lens), (num_kv_heads, group, head_dim) = lens, heads
    batch = PagedBatch(seq_lens, q_lens, page_size=page_size, num_q_heads=num_kv_heads * group,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32, seed=seed)
    out = paged_attention_ref(*batch.args(), sm_scale=0.3, sliding_window=window)
    expected = batch.naive(sm_scale=0.3, sliding_window=window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_batch_with_different_context_lengths():
    """q_len = 1 for every sequence (plain decode), contexts 1..40, one launch."""
    batch = PagedBatch([1, 13, 40, 27], [1, 1, 1, 1], page_size=8, num_q_heads=8, num_kv_heads=2,
                       head_dim=64, dtype=torch.float16, seed=2)
    out = paged_attention(*batch.args(), sm_scale=0.125)
    assert_close(out, paged_attention_ref(*batch.args(), sm_scale=0.125), torch.float16)


def test_verification_of_k_drafts_sees_context_and_earlier_drafts():
    """q_len = k + 1 = 5 new tokens after 30 cached ones: token i sees positions 0 .. 30 + i."""
    batch = PagedBatch([35, 9], [5, 5], page_size=4, num_q_heads=4, num_kv_heads=1, head_dim=32,
                       dtype=torch.float32, seed=3)
    out = paged_attention(*batch.args(), sm_scale=0.2, block_n=16)
    torch.testing.assert_close(out.double(), batch.naive(sm_scale=0.2, sliding_window=None).to(DEVICE),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 4, 7])
def test_split_kv_combine_is_exact(num_splits):
    """Splitting the keys across programs and combining (acc, m, l) equals the unsplit result,
    including splits that hold no visible key for some rows (window 6 < split length)."""
    batch = PagedBatch([40, 33, 2], [1, 3, 2], page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16,
                       dtype=torch.float32, seed=4)
    for window in (None, 6):
        unsplit = paged_attention(*batch.args(), sm_scale=0.25, sliding_window=window, num_splits=1, block_n=16)
        split = paged_attention(*batch.args(), sm_scale=0.25, sliding_window=window, num_splits=num_splits,
                                block_n=16)
        torch.testing.assert_close(split, unsplit, atol=1e-6, rtol=1e-6)


def test_whole_prompt_in_paged_attention_equals_flash_prefill():
    """A prefill chunk that is the whole prompt (q_len = seq_len) is plain causal self-attention."""
    batch = PagedBatch([17, 6], [17, 6], page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=32,
                       dtype=torch.float32, seed=5)
    k = torch.cat(batch.dense_k).to(DEVICE)  # [T, Hkv, D]
    v = torch.cat(batch.dense_v).to(DEVICE)
    paged = paged_attention(*batch.args(), sm_scale=0.2, block_m=16, block_n=16)
    flat = flash_prefill(batch.q, k, v, batch.query_start_loc, 17, sm_scale=0.2, block_m=16, block_n=16)
    torch.testing.assert_close(paged, flat, atol=1e-5, rtol=1e-5)


def test_page_ids_beyond_int32_element_offsets():
    """Pages at the end of a pool of more than 2^31 elements: page_id * page_stride needs int64.

    The pool is allocated with torch.empty, so only the pages written here take memory.
    """
    page_size, num_kv_heads, head_dim = 4, 1, 16
    num_pages = 2**31 // (page_size * num_kv_heads * head_dim) + 8  # [2^25 + 8] pages of 64 elements
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)  # ~4 GiB of virtual memory
    v_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    seq_len = 10
    pages = torch.tensor([num_pages - 1, num_pages - 5, num_pages - 3], dtype=torch.int32, device=DEVICE)
    slots = (pages.long()[:, None] * page_size + torch.arange(page_size, device=DEVICE)).flatten()[:seq_len]
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).half().to(DEVICE)  # [L, Hkv, D]
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).half().to(DEVICE)
    write_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[pages.long()].flatten(0, 1)[:seq_len], k, atol=0, rtol=0)

    q = torch.randn(3, 2, head_dim, generator=gen).half().to(DEVICE)  # [q_len, Hq, D]
    args = (q, k_cache, v_cache, pages[None, :], torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 3], dtype=torch.int32, device=DEVICE), 3, seq_len)
    assert_close(paged_attention(*args, sm_scale=0.25, block_n=16), paged_attention_ref(*args, sm_scale=0.25),
                 torch.float16)


# --------------------------------------------------------------------------- write_kv


@settings(max_examples=10, deadline=None)
@given(num_tokens=st.integers(1, 24), page_size=st.sampled_from([1, 4, 16]), heads=head_shapes,
       dtype=cpu_dtypes, seed=seeds)
def test_write_kv_scatters_to_slots_and_skips_negative(num_tokens, page_size, heads, dtype, seed):
    """Token t lands in page slot // page_size at offset slot % page_size; slot -1 writes nothing."""
    num_kv_heads, _, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    num_pages = num_tokens // page_size + 3
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]  # distinct slots
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    slots = slots.to(DEVICE)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_ref[slot // page_size, slot % page_size], k[t])


# --------------------------------------------------------------------------- bad launches


def _paged_call(**overrides):
    batch = PagedBatch([9, 5], [2, 1], page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=16,
                       dtype=torch.float32, seed=7, extra_columns=0)
    args = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, block_tables=batch.block_tables,
                seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc,
                max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)
    args.update(overrides)
    return args


PAGED_BAD_LAUNCHES = {
    "multiple of kv heads": lambda a: dict(q=torch.randn(3, 3, 16, device=DEVICE)),
    "dtypes differ": lambda a: dict(q=a["q"].half()),
    "head_dim 48 is not supported": lambda a: dict(
        q=torch.randn(3, 4, 48, device=DEVICE), k_cache=torch.randn(8, 4, 2, 48, device=DEVICE),
        v_cache=torch.randn(8, 4, 2, 48, device=DEVICE)),
    "head_dim 512 is not supported": lambda a: dict(
        q=torch.randn(3, 4, 512, device=DEVICE), k_cache=torch.randn(8, 4, 2, 512, device=DEVICE),
        v_cache=torch.randn(8, 4, 2, 512, device=DEVICE)),
    "block_tables has 3 columns": lambda a: dict(max_seq_len=13),
    "more than max_seq_len": lambda a: dict(seq_lens=torch.tensor([12, 5], dtype=torch.int32, device=DEVICE)),
    "q_len <= seq_len": lambda a: dict(seq_lens=torch.tensor([1, 5], dtype=torch.int32, device=DEVICE)),
    "more than max_query_len": lambda a: dict(max_query_len=1),
    "is not a page id": lambda a: dict(block_tables=torch.tensor([[0, 99, 0], [1, 2, 3]], dtype=torch.int32,
                                                                 device=DEVICE)),
    "block_tables must be a 2-D int32": lambda a: dict(block_tables=a["block_tables"].long()),
    "query_start_loc must run from 0 to T": lambda a: dict(
        query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)),
    "seq_lens must be contiguous": lambda a: dict(  # a strided view: the kernel would read between its values
        seq_lens=torch.stack([a["seq_lens"], a["seq_lens"]], 1)[:, 0]),
}


@pytest.mark.parametrize("message", list(PAGED_BAD_LAUNCHES))
@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref], ids=["kernel", "ref"])
def test_paged_attention_rejects_bad_launch_before_running(fn, message):
    """A malformed launch raises ValueError naming the problem (it never reaches the kernel)."""
    args = _paged_call()
    args.update(PAGED_BAD_LAUNCHES[message](args))
    with pytest.raises(ValueError, match=message):
        fn(**args, sm_scale=0.25)


def test_value_checks_run_by_default_on_every_device():
    """validate=None checks index values on CPU and GPU alike (on an H200 a bad launch that skipped
    them ended in a device-side assert that broke every later CUDA call); only a CUDA graph
    capture, where a sync is an error, skips them, and an explicit True/False wins."""
    t = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    assert should_validate(None, t) and should_validate(True, t) and not should_validate(False, t)


@pytest.mark.parametrize("fn", [flash_prefill, flash_prefill_ref], ids=["kernel", "ref"])
def test_flash_prefill_rejects_bad_launch_before_running(fn):
    """Head count, head dim, dtype and sequence-length mistakes are ValueErrors with a reason."""
    q, k, v, cu_seqlens = packed_batch([3, 4], 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fn(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu_seqlens, 4, sm_scale=1.0)
    with pytest.raises(ValueError, match="dtypes differ"):
        fn(q, k.half(), v.half(), cu_seqlens, 4, sm_scale=1.0)
    with pytest.raises(ValueError, match="head_dim 48"):
        fn(q.repeat(1, 1, 3), k.repeat(1, 1, 3), v.repeat(1, 1, 3), cu_seqlens, 4, sm_scale=1.0)
    with pytest.raises(ValueError, match="more than max_seqlen"):
        fn(q, k, v, cu_seqlens, 3, sm_scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32"):
        fn(q, k, v, cu_seqlens.long(), 4, sm_scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens must be contiguous"):  # (read past its values, out of bounds)
        fn(q, k, v, torch.stack([cu_seqlens, cu_seqlens], 1)[:, 0], 4, sm_scale=1.0)


@pytest.mark.parametrize("fn", [write_kv, write_kv_ref], ids=["kernel", "ref"])
def test_write_kv_rejects_bad_launch_before_running(fn):
    """slot_mapping must be int64 and inside the pool; shapes and dtypes must match the cache."""
    k = torch.randn(3, 2, 16, device=DEVICE)
    cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 5, -1], device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        fn(k, k, cache, cache.clone(), slots.int())
    with pytest.raises(ValueError, match="outside the pool"):
        fn(k, k, cache, cache.clone(), torch.tensor([0, 16, -1], device=DEVICE))
    with pytest.raises(ValueError, match="dtypes differ"):
        fn(k.half(), k.half(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="differ from k's"):
        fn(k[:, :1], k[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):  # (a review saw heap corruption)
        fn(k, k, cache, cache.clone(), torch.tensor([0, 100, 5, 100, 7, 100], device=DEVICE)[::2])
    assert not cache.any(), "a rejected launch wrote to the cache"


# --------------------------------------------------------------------------- bf16 on GPU


@pytest.mark.slow
@needs_gpu
def test_bf16_kernels_match_reference_on_gpu():
    """bf16 (wrong under the interpreter) on a real GPU: prefill, decode and verification."""
    q, k, v, cu_seqlens = packed_batch([1, 70, 129], 8, 2, 128, torch.bfloat16, seed=8)
    assert_close(flash_prefill(q, k, v, cu_seqlens, 129, sm_scale=128**-0.5),
                 flash_prefill_ref(q, k, v, cu_seqlens, 129, sm_scale=128**-0.5), torch.bfloat16)
    batch = PagedBatch([200, 1, 77], [5, 1, 77], page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=128,
                       dtype=torch.bfloat16, seed=9)
    for num_splits in (None, 1, 4):
        assert_close(paged_attention(*batch.args(), sm_scale=128**-0.5, num_splits=num_splits),
                     paged_attention_ref(*batch.args(), sm_scale=128**-0.5), torch.bfloat16)
