"""Causal FlashAttention over a packed variable-length batch (the prefill of new prompts).

Math (per sequence b, query head h, kv head g = h // (Hq // Hkv), positions 0..L_b-1):

    S[i, j] = sm_scale * <q_i, k_j>          allowed iff j <= i and i - j < W
    O[i]    = sum_j softmax_j(S[i, :]) v_j

W is the sliding window (HF Mistral convention: the window counts the token itself, so W = 1
attends to the token alone); no window means W = infinity.

Shapes: q [T, Hq, D]; k, v [T, Hkv, D]; cu_seqlens [B+1] int32 with cu_seqlens[0] = 0 and
cu_seqlens[B] = T (sequence b owns rows cu_seqlens[b] : cu_seqlens[b+1]); out [T, Hq, D] in q's
dtype. Grouped-query attention reads the shared kv head in place, no copy.

The kernel is FlashAttention-2 (Dao 2023, Algorithm 1) in the shape of Triton tutorial 06: one
program owns BLOCK_M queries of one head and streams key tiles of BLOCK_N, keeping the running
row max m_i, the running softmax denominator l_i and the unnormalised output acc in fp32
("online softmax", Milakov & Gimelshein 2018). Scores are kept in base 2 (exp2 with
sm_scale * log2(e)), which is exact up to rounding. Key tiles that the causal mask or the window
hide for every query of the program are never visited.
"""

import math

import torch

from minispec.kernels._checks import check, check_dense, check_head_dim, check_same_device, dot_precision, no_window, should_validate
from minispec.kernels._triton import tl, triton
from minispec.kernels.reference import masked_attention

LOG2_E = 1.4426950408889634


@triton.jit
def _flash_prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    out_ptr,  # [T, Hq, D]
    cu_seqlens_ptr,  # [B + 1] int32
    stride_qt, stride_qh,  # q strides (the D stride is 1)
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    qk_scale,  # sm_scale * log2(e): scores in base 2
    window,  # sliding window W (a huge number when there is none)
    QUERIES_PER_KV: tl.constexpr,  # Hq // Hkv
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # see dot_precision()
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // QUERIES_PER_KV

    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    first_query = tile * BLOCK_M
    if first_query >= seq_len:  # the grid is sized for the longest sequence
        return

    offs_m = first_query + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions in the sequence
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    query_in = offs_m < seq_len  # [BLOCK_M]

    # [BLOCK_M, D]
    q_ptrs = q_ptr + (seq_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=query_in[:, None], other=0.0)

    # Keys that any query of this tile may see: [key_lo, key_hi).
    last_query = tl.minimum(first_query + BLOCK_M, seq_len) - 1
    key_lo = tl.maximum(first_query - window + 1, 0)
    key_hi = last_query + 1

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (finite: no inf - inf)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exp2(s - m_i) v

    for start_n in range(key_lo, key_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_in = offs_n < key_hi
        rows = (seq_start + offs_n).to(tl.int64)  # [BLOCK_N]
        # K loaded transposed, [D, BLOCK_N]; V as [BLOCK_N, D]
        k_t = tl.load(k_ptr + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                      mask=key_in[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=key_in[:, None], other=0.0)

        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (key_in[None, :]
                   & (offs_n[None, :] <= offs_m[:, None])
                   & (offs_m[:, None] - offs_n[None, :] < window))
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Padding rows past the sequence end may have seen no key; keep them finite (never stored).
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    # [BLOCK_M, D]
    out_ptrs = out_ptr + (seq_start + offs_m)[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=query_in[:, None])


def default_prefill_tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a head dim: 64 x 64 up to D = 64, 64 x 32 above.

    Conservative sizes that fit the shared memory of any recent NVIDIA GPU with the default
    pipelining; no autotuning, so every run launches the same kernel. With NUM_WARPS they compile
    without register spills on sm_80 / sm_90 (tools/aot.py; 64 x 64 tiles with 4 warps spilled
    on sm_80 at D = 128: 255 registers + 8 bytes).
    """
    return (64, 64) if head_dim <= 64 else (64, 32)


NUM_WARPS = 8


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    validate: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of every packed sequence over itself; returns [T, Hq, D] in q's dtype.

    max_seqlen is a host int >= the longest sequence (it sizes the grid without a device sync).
    validate checks the values in cu_seqlens, which syncs with the device; None means "unless
    capturing a CUDA graph" (the engine passes False on its hot path; shape and dtype checks
    always run).
    block_m / block_n override the tile sizes (tests use small tiles so that short sequences
    span several tiles; None picks `default_prefill_tiles`).
    """
    _check_prefill_args(q, k, v, cu_seqlens, max_seqlen, sliding_window, validate)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    default_m, default_n = default_prefill_tiles(head_dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        check(size >= 16 and size & (size - 1) == 0, lambda: f"{name} must be a power of two >= 16, got {size}")

    out = torch.empty_like(q)  # [T, Hq, D]
    num_seqs = cu_seqlens.numel() - 1
    if num_tokens == 0 or num_seqs == 0 or max_seqlen == 0:
        return out
    grid = (triton.cdiv(max_seqlen, block_m), num_seqs, num_q_heads)
    _flash_prefill_kernel[grid](
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, cu_seqlens_ptr=cu_seqlens,
        stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_ot=out.stride(0), stride_oh=out.stride(1),
        qk_scale=sm_scale * LOG2_E,
        window=no_window() if sliding_window is None else sliding_window,
        QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=NUM_WARPS,
    )
    return out


def flash_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    validate: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `flash_prefill` (same signature; tile sizes are ignored).

    One fp32 masked softmax per sequence, all heads at once; output in q's dtype.
    """
    _check_prefill_args(q, k, v, cu_seqlens, max_seqlen, sliding_window, validate)
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)  # [T, Hq, D]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        positions = torch.arange(end - start, device=q.device)  # [L]
        out[start:end] = masked_attention(q[start:end], k[start:end], v[start:end], positions,
                                          group=group, sm_scale=sm_scale, sliding_window=sliding_window)
    return out


def _check_prefill_args(q, k, v, cu_seqlens, max_seqlen, sliding_window, validate) -> None:
    """Checks shared by the kernel and its reference; the value checks only when validating."""
    check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
          lambda: f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    check(k.shape == v.shape, lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    check(k.shape[0] == num_tokens and k.shape[2] == head_dim,
          lambda: f"k/v {tuple(k.shape)} must be [T={num_tokens}, Hkv, D={head_dim}] like q {tuple(q.shape)}")
    num_kv_heads = k.shape[1]
    check(num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
          lambda: f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    check_head_dim(head_dim)
    check(q.dtype == k.dtype == v.dtype, lambda: f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), lambda: f"unsupported dtype {q.dtype}")
    check(cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1 and cu_seqlens.dtype == torch.int32,
          lambda: f"cu_seqlens must be a 1-D int32 tensor [B+1]; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    check_dense(cu_seqlens=cu_seqlens)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check(t.stride(2) == 1, lambda: f"{name} must be contiguous in its last (head_dim) dimension")
    check(sliding_window is None or sliding_window >= 1, lambda: f"sliding_window must be >= 1, got {sliding_window}")
    check(max_seqlen >= 0, lambda: f"max_seqlen must be >= 0, got {max_seqlen}")
    validate = should_validate(validate, cu_seqlens)
    if validate and cu_seqlens.numel() > 1:
        seq_lens = cu_seqlens.diff()  # [B]
        check(int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == q.shape[0],
              lambda: f"cu_seqlens must run from 0 to T={q.shape[0]}; got {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}")
        check(bool((seq_lens >= 0).all()), "cu_seqlens must be non-decreasing")
        check(int(seq_lens.max()) <= max_seqlen,
              lambda: f"a sequence has {int(seq_lens.max())} tokens, more than max_seqlen={max_seqlen}")
