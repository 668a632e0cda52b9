"""Attention of new tokens over a paged KV cache: decode, speculative verification, chunked prefill.

Sequence b has seq_lens[b] tokens in the cache, the last q_len_b of which are new (their K/V are
already written); its new tokens are rows query_start_loc[b] : query_start_loc[b+1] of q and sit
at positions p = seq_lens[b] - q_len_b + i, i = 0..q_len_b-1. Each sees the keys j with

    j <= p  and  p - j < W            (W = sliding window, counting the token itself)

    O[p] = sum_j softmax_j(sm_scale <q_p, k_j>) v_j

q_len_b = 1 is decode, k + 1 is the verification of k draft tokens, anything larger is a
prefill chunk; one launch serves a batch that mixes them.

Tree mask (tree verification, tree drafting). With tree_start [B] int32 and tree_bits [T] int64,
the keys j >= tree_start[b] of sequence b form its tree block: drafted nodes, each at its own
key index but at RoPE position base + depth, so siblings share a position. A new token at p then
sees such a key only if bit (j - tree_start[b]) of its tree_bits row is set (its ancestors and
itself; at most 63 nodes per block):

    j <= p  and  (j < tree_start[b]  or  tree_bits[p] >> (j - tree_start[b]) & 1)  and  P - P_j < W

The window measures positions, which in a tree block are not key indices: a node (bits != 0)
sits at P = tree_start[b] - 1 + popcount(bits) (its root, the key before the block, plus its
depth: the runner checks this of every tree feed), a key before the block at P_j = j, and the
node's ancestor j at popcount(bits >> (j - tree_start[b] + 1)) levels above it; for every other
row P - P_j = p - j (kernels/reference.py, `visible_keys`, is the rule in torch). A sequence
without a tree has tree_start[b] = seq_lens[b] (no key is in its block).

Shapes: q [T, Hq, D]; k_cache, v_cache [num_pages, page_size, Hkv, D]; block_tables
[B, max_pages_per_seq] int32, key j of sequence b lives in page block_tables[b, j // page_size]
at offset j % page_size; seq_lens [B] int32; query_start_loc [B+1] int32; out [T, Hq, D] in q's
dtype.

Kernel layout (learned from vLLM's triton_unified_attention, written afresh): one program owns
BLOCK_Q new tokens of one sequence times all GROUP query heads that share one kv head, so a
BLOCK_M = BLOCK_Q * GROUP_PAD row tile reads each K/V tile once for the whole group (decode is
memory-bound: that is where grouped-query attention saves its bandwidth). Keys are gathered one
by one through the block table, so any page size works. Rows are streamed with the online
softmax of FlashAttention (m_i, l_i, acc in fp32).

When there are too few (sequence, query tile, kv head) programs to fill the GPU, as in decode
of a small batch with long contexts, the key range is split across NUM_SPLITS programs
(flash-decoding, Dao et al. 2023). Each writes its unnormalised partial (acc, m, l); a second
kernel combines them exactly:

    M = max_s m_s,   O = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
"""

import functools

import torch

from minispec.kernels._checks import check, check_dense, check_head_dim, check_same_device, dot_precision, no_window, should_validate
from minispec.kernels._triton import tl, triton
from minispec.kernels.reference import masked_attention

LOG2_E = 1.4426950408889634
MAX_SPLITS = 16


@triton.jit
def _popcount(x):
    """Set bits of each int64 in 0..2^63 - 1 (as kernels/reference.py's `popcount`)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return (x + (x >> 8) + (x >> 16) + (x >> 24) + (x >> 32) + (x >> 40) + (x >> 48) + (x >> 56)) & 0x7F


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    out_ptr,  # [T, Hq, D], written when NUM_SPLITS == 1
    acc_partial_ptr,  # [T, Hq, NUM_SPLITS, D] fp32, written when NUM_SPLITS > 1
    m_partial_ptr,  # [T, Hq, NUM_SPLITS] fp32
    l_partial_ptr,  # [T, Hq, NUM_SPLITS] fp32
    block_tables_ptr,  # [B, max_pages_per_seq] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    tree_start_ptr,  # [B] int32, key index where sequence b's tree block starts (HAS_TREE only)
    tree_bits_ptr,  # [T] int64, bit j: the new token sees tree key tree_start + j (HAS_TREE only)
    stride_qt, stride_qh,  # the D stride of every tensor is 1
    stride_kp, stride_ks, stride_kh,  # k_cache: page, slot in page, head
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_at, stride_ah, stride_as,  # acc_partial: token, head, split
    stride_mt, stride_mh,  # m_partial and l_partial (same layout)
    stride_bt,  # block_tables row
    page_size,
    qk_scale,  # sm_scale * log2(e): scores in base 2
    window,  # sliding window W (a huge number when there is none)
    QUERIES_PER_KV: tl.constexpr,  # Hq // Hkv
    GROUP_PAD: tl.constexpr,  # QUERIES_PER_KV rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # new tokens per program = BLOCK_M // GROUP_PAD
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # see dot_precision()
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_TREE: tl.constexpr,  # a tree mask is given (compiled out otherwise)
    SHORT_WINDOW: tl.constexpr,  # with a tree: W < 63 (test models), so even a node's ancestors may lie outside it
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the longest query
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens before the new ones

    # Row r of the tile is new token q_tile * BLOCK_Q + r // GROUP_PAD, query head r % GROUP_PAD
    # of the group.
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_index = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] index among the new tokens
    head = kv_head * QUERIES_PER_KV + offs_m % GROUP_PAD  # [BLOCK_M] query head
    row_in = (q_index < q_len) & (offs_m % GROUP_PAD < QUERIES_PER_KV)  # [BLOCK_M]
    q_pos = context_len + q_index  # [BLOCK_M] key index (and, outside a tree block, position)
    token = (q_start + q_index).to(tl.int64)  # [BLOCK_M] row of q / out
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    first_pos = context_len + q_tile * BLOCK_Q  # the tile's first key index
    if HAS_TREE:
        tree_start = tl.load(tree_start_ptr + seq)
        bits = tl.load(tree_bits_ptr + token, mask=row_in, other=0)  # [BLOCK_M] int64
        depth = _popcount(bits).to(tl.int32)  # [BLOCK_M], 0 for a row outside the tree
        q_real = tl.where(bits != 0, tree_start - 1 + depth, q_pos)  # [BLOCK_M] position

    # [BLOCK_M, D]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_in[:, None], other=0.0)

    # Keys that any token of this tile may see, [key_lo, key_hi), then this split's share of
    # them in whole tiles.
    key_lo = tl.maximum(first_pos - window + 1, 0)
    if HAS_TREE:  # a node's position trails its key index by at most 62
        key_lo = tl.maximum(key_lo - 63, 0)
    key_hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
    tiles_per_split = tl.cdiv(tl.cdiv(key_hi - key_lo, BLOCK_N), NUM_SPLITS)
    split_lo = key_lo + split * tiles_per_split * BLOCK_N
    split_hi = tl.minimum(split_lo + tiles_per_split * BLOCK_N, key_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (finite: no inf - inf)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exp2(s - m_i) v

    for start_n in range(split_lo, split_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_in = offs_n < split_hi
        # [BLOCK_N] page of each key; int64 before the stride product (pools exceed 2^31 elements)
        page = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + offs_n // page_size,
                       mask=key_in, other=0).to(tl.int64)
        slot = offs_n % page_size  # [BLOCK_N]
        kv_offset = page * stride_kp + slot * stride_ks  # [BLOCK_N]
        # K loaded transposed, [D, BLOCK_N]; V as [BLOCK_N, D]
        k_t = tl.load(k_cache_ptr + kv_offset[None, :] + kv_head * stride_kh + offs_d[:, None],
                      mask=key_in[None, :], other=0.0)
        v_offset = page * stride_vp + slot * stride_vs  # [BLOCK_N]
        v = tl.load(v_cache_ptr + v_offset[:, None] + kv_head * stride_vh + offs_d[None, :],
                    mask=key_in[:, None], other=0.0)

        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = key_in[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_TREE:  # a key in the tree block is seen only by its descendants (and itself)
            rel = tl.minimum(tl.maximum(offs_n - tree_start, 0), 63).to(tl.int64)  # [BLOCK_N]
            ancestor = ((bits[:, None] >> rel[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N]
            before = offs_n[None, :] < tree_start  # [1, BLOCK_N]
            in_block = offs_n[None, :] >= tree_start
            # The window in positions: keys before the block from the row's position; an
            # ancestor is at most 62 levels up, inside any window of 63 or more.
            near = (q_real[:, None] - offs_n[None, :] < window) | in_block  # [BLOCK_M, BLOCK_N]
            if SHORT_WINDOW:
                above = _popcount(bits[:, None] >> tl.minimum(rel + 1, 63)[None, :])  # levels up
                near = tl.where(in_block, above < window, near)
            visible = visible & (before | ancestor) & near
        else:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Padding rows may have seen no key; keep them finite (they are not stored).
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        # [BLOCK_M, D]
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None])
    else:
        # A split that no key of a row falls in stores m = -1e30, l = 0, acc = 0: weight 0 below.
        ml_offset = token * stride_mt + head * stride_mh + split  # [BLOCK_M]
        tl.store(m_partial_ptr + ml_offset, m_i, mask=row_in)
        tl.store(l_partial_ptr + ml_offset, l_i, mask=row_in)
        # [BLOCK_M, D]
        acc_ptrs = (acc_partial_ptr + token[:, None] * stride_at + head[:, None] * stride_ah
                    + split * stride_as + offs_d[None, :])
        tl.store(acc_ptrs, acc, mask=row_in[:, None])


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, Hq, D]
    acc_partial_ptr,  # [T, Hq, NUM_SPLITS, D] fp32
    m_partial_ptr,  # [T, Hq, NUM_SPLITS] fp32
    l_partial_ptr,  # [T, Hq, NUM_SPLITS] fp32
    stride_ot, stride_oh,
    stride_at, stride_ah, stride_as,
    stride_mt, stride_mh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    split_in = offs_s < NUM_SPLITS

    ml_ptrs = token * stride_mt + head * stride_mh + offs_s  # [SPLITS_PAD]
    m_s = tl.load(m_partial_ptr + ml_ptrs, mask=split_in, other=float("-inf"))
    l_s = tl.load(l_partial_ptr + ml_ptrs, mask=split_in, other=0.0)
    # [SPLITS_PAD, D]
    acc_s = tl.load(acc_partial_ptr + token * stride_at + head * stride_ah
                    + offs_s[:, None] * stride_as + offs_d[None, :],
                    mask=split_in[:, None], other=0.0)

    weight = tl.exp2(m_s - tl.max(m_s, axis=0))  # [SPLITS_PAD]
    out = tl.sum(weight[:, None] * acc_s, axis=0) / tl.sum(weight * l_s, axis=0)  # [D]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def default_paged_tiles(head_dim: int, max_query_len: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 16 rows when one token's query heads fit (decode), else 64.

    BLOCK_M never drops below the padded group, so one program always holds all query heads of a
    kv head. BLOCK_N is 64 keys, except 32 for the 64-row tiles at D = 128 and at D = 256: the
    choice that compiles without register spills on sm_80 and sm_90 for the supported models
    (tools/aot.py; tests/test_aot.py checks every default launch). 64 keys there spilled on
    sm_80 (D = 128, 4 query heads per kv head, a k = 4 verification: 255 registers + 8 bytes).
    """
    group_pad = triton.next_power_of_2(group)
    block_m = max(16 if max_query_len * group_pad <= 16 else 64, group_pad)
    block_n = 64 if head_dim <= 64 or (head_dim <= 128 and block_m == 16) else 32
    return block_m, block_n, 4


def default_num_splits(num_programs: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """How many programs share one key range: enough to give the GPU ~4 programs per SM.

    Each split keeps at least 4 key tiles, and there are at most MAX_SPLITS. On CPU it is 1.
    """
    if device.type != "cuda":
        return 1
    target = 4 * _multiprocessor_count(device)
    by_occupancy = triton.cdiv(target, max(num_programs, 1))
    by_length = triton.cdiv(max_seq_len, 4 * block_n)
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    validate: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    tree_start: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their paged cache; returns [T, Hq, D] in q's dtype.

    max_query_len and max_seq_len are host ints bounding q_len_b and seq_lens[b] (they size the
    grid without a device sync). num_splits forces the flash-decoding split (None: heuristic).
    validate checks the values of seq_lens, query_start_loc and block_tables, which syncs with
    the device; None means "unless capturing a CUDA graph" (the engine passes False on its hot
    path; shape and dtype checks always run). block_m / block_n override the tile sizes.
    tree_start / tree_bits: the tree mask (module docstring), both or neither.
    """
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                     max_query_len, max_seq_len, sliding_window, validate)
    check_tree_args(q, seq_lens, tree_start, tree_bits, validate)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    default_m, default_n, num_warps = default_paged_tiles(head_dim, max_query_len, group)
    block_m, block_n = block_m or default_m, block_n or default_n
    check(block_m >= max(16, group_pad) and block_m & (block_m - 1) == 0,
          lambda: f"block_m must be a power of two >= max(16, query heads per kv head = {group}), got {block_m}")
    check(block_n >= 16 and block_n & (block_n - 1) == 0, lambda: f"block_n must be a power of two >= 16, got {block_n}")
    block_q = block_m // group_pad

    out = torch.empty_like(q)  # [T, Hq, D]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs * num_q_tiles * num_kv_heads, max_seq_len, block_n, q.device)
    check(1 <= num_splits <= MAX_SPLITS, lambda: f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")

    if num_splits == 1:
        acc_partial = m_partial = l_partial = out  # unused by the kernel; any tensor will do
        partial_strides = dict(stride_at=0, stride_ah=0, stride_as=0, stride_mt=0, stride_mh=0)
    else:
        acc_partial = q.new_empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32)
        m_partial = q.new_empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32)
        l_partial = torch.empty_like(m_partial)  # [T, Hq, num_splits]
        partial_strides = dict(
            stride_at=acc_partial.stride(0), stride_ah=acc_partial.stride(1), stride_as=acc_partial.stride(2),
            stride_mt=m_partial.stride(0), stride_mh=m_partial.stride(1),
        )

    grid = (num_seqs, num_q_tiles, num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, out_ptr=out,
        acc_partial_ptr=acc_partial, m_partial_ptr=m_partial, l_partial_ptr=l_partial,
        block_tables_ptr=block_tables, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
        tree_start_ptr=seq_lens if tree_start is None else tree_start,  # unread without a tree
        tree_bits_ptr=query_start_loc if tree_bits is None else tree_bits,
        stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kp=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vp=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        stride_ot=out.stride(0), stride_oh=out.stride(1),
        **partial_strides,
        stride_bt=block_tables.stride(0),
        page_size=k_cache.shape[1],
        qk_scale=sm_scale * LOG2_E,
        window=no_window() if sliding_window is None else sliding_window,
        QUERIES_PER_KV=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        HAS_TREE=tree_start is not None, num_warps=num_warps,
        SHORT_WINDOW=tree_start is not None and sliding_window is not None and sliding_window < 63,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out_ptr=out, acc_partial_ptr=acc_partial, m_partial_ptr=m_partial, l_partial_ptr=l_partial,
            stride_ot=out.stride(0), stride_oh=out.stride(1), **partial_strides,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            num_warps=1,
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    validate: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    tree_start: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `paged_attention` (same signature; num_splits and tiles are ignored).

    Per sequence: gather its pages through the block table into [seq_len, Hkv, D] and take one
    fp32 masked softmax (`masked_attention`, kernels/reference.py) for all its new tokens and
    heads. Output in q's dtype. (The torch backend runs the same math batched over the sequences
    on CPU: minispec/fast/attention_plans.py.)
    """
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                     max_query_len, max_seq_len, sliding_window, validate)
    check_tree_args(q, seq_lens, tree_start, tree_bits, validate)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)  # [T, Hq, D]
    for seq, seq_len in enumerate(lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end == q_start:  # no new tokens
            continue
        pages = block_tables[seq, : triton.cdiv(seq_len, page_size)].long()  # [n_pages]
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, Hkv, D]
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, Hkv, D]
        positions = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)  # [q_len] key indices
        tree = None if tree_start is None else (int(tree_start[seq]), tree_bits[q_start:q_end])
        out[q_start:q_end] = masked_attention(q[q_start:q_end], keys, values, positions, group=group,
                                              sm_scale=sm_scale, sliding_window=sliding_window, tree=tree)
    return out


def check_tree_args(q, seq_lens, tree_start, tree_bits, validate) -> None:
    """The tree mask: both tensors or neither, tree_start int32 [B], tree_bits int64 [T]."""
    check((tree_start is None) == (tree_bits is None), "give tree_start and tree_bits together, or neither")
    if tree_start is None:
        return
    check(tree_start.shape == seq_lens.shape and tree_start.dtype == torch.int32,
          lambda: f"tree_start must be int32 [B={seq_lens.shape[0]}]; got {tree_start.dtype} {tuple(tree_start.shape)}")
    check(tree_bits.shape == q.shape[:1] and tree_bits.dtype == torch.int64,
          lambda: f"tree_bits must be int64 [T={q.shape[0]}]; got {tree_bits.dtype} {tuple(tree_bits.shape)}")
    check_same_device(q=q, tree_start=tree_start, tree_bits=tree_bits)
    check_dense(tree_start=tree_start, tree_bits=tree_bits)
    if should_validate(validate, q) and seq_lens.numel():
        check(bool(((seq_lens - tree_start) <= 63).all() & (tree_start >= 0).all()),
              "a tree block holds at most 63 keys and starts at a key index >= 0")


def check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      max_query_len, max_seq_len, sliding_window, validate) -> None:
    """Checks shared by the kernel and its reference; the value checks only when validating."""
    check(q.dim() == 3, lambda: f"q must be [T, Hq, D]; got {tuple(q.shape)}")
    check(k_cache.dim() == 4, lambda: f"k_cache must be [num_pages, page_size, Hkv, D]; got {tuple(k_cache.shape)}")
    check(k_cache.shape == v_cache.shape,
          lambda: f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape")
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    check(cache_head_dim == head_dim, lambda: f"head_dim of q ({head_dim}) and of the cache ({cache_head_dim}) differ")
    check(num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
          lambda: f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    check_head_dim(head_dim)
    check(page_size >= 1, "page_size must be >= 1")
    check(q.dtype == k_cache.dtype == v_cache.dtype,
          lambda: f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), lambda: f"unsupported dtype {q.dtype}")
    check(block_tables.dim() == 2 and block_tables.dtype == torch.int32,
          lambda: f"block_tables must be a 2-D int32 tensor [B, max_pages]; got {block_tables.dtype} {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    check(seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32,
          lambda: f"seq_lens must be int32 [B={num_seqs}]; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    check(query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32,
          lambda: f"query_start_loc must be int32 [B+1={num_seqs + 1}]; got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check(t.stride(-1) == 1, lambda: f"{name} must be contiguous in its last (head_dim) dimension")
    check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    check_dense(seq_lens=seq_lens, query_start_loc=query_start_loc)
    check(sliding_window is None or sliding_window >= 1, lambda: f"sliding_window must be >= 1, got {sliding_window}")
    check(0 <= max_query_len <= max_seq_len,
          lambda: f"need 0 <= max_query_len ({max_query_len}) <= max_seq_len ({max_seq_len})")
    pages_needed = -(-max_seq_len // page_size)
    check(block_tables.shape[1] >= pages_needed,
          lambda: f"block_tables has {block_tables.shape[1]} columns but max_seq_len={max_seq_len} "
          f"needs ceil({max_seq_len}/{page_size}) = {pages_needed} pages")

    validate = should_validate(validate, q)
    if not validate or num_seqs == 0:
        return
    q_lens = query_start_loc.diff()  # [B]
    check(int(query_start_loc[0]) == 0 and int(query_start_loc[-1]) == num_tokens,
          lambda: f"query_start_loc must run from 0 to T={num_tokens}; "
          f"got {int(query_start_loc[0])}..{int(query_start_loc[-1])}")
    check(bool((q_lens >= 0).all()), "query_start_loc must be non-decreasing")
    check(int(q_lens.max()) <= max_query_len,
          lambda: f"a sequence has {int(q_lens.max())} new tokens, more than max_query_len={max_query_len}")
    check(bool((q_lens <= seq_lens).all()),
          lambda: f"every sequence needs q_len <= seq_len (its new tokens are in the cache); "
          f"q_lens {q_lens.tolist()}, seq_lens {seq_lens.tolist()}")
    check(int(seq_lens.max()) <= max_seq_len,
          lambda: f"a sequence has {int(seq_lens.max())} tokens, more than max_seq_len={max_seq_len}")
    pages_used = (seq_lens.long() + page_size - 1) // page_size  # [B]
    in_use = torch.arange(block_tables.shape[1], device=q.device)[None, :] < pages_used[:, None]  # [B, max_pages]
    bad = in_use & ((block_tables < 0) | (block_tables >= num_pages))
    if bool(bad.any()):
        seq, column = bad.nonzero()[0].tolist()
        raise ValueError(f"block_tables[{seq}, {column}] = {int(block_tables[seq, column])} is not a page id "
                         f"in 0..{num_pages - 1}, yet sequence {seq} uses that column")
