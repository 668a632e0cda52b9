"""Scatter the keys and values of new tokens into the paged KV cache, in place.

    k_cache[slot // page_size, slot % page_size] = k[t]     for every t with slot = slot_mapping[t] >= 0
    (same for v)

Shapes: k, v [T, Hkv, D]; k_cache, v_cache [num_pages, page_size, Hkv, D]; slot_mapping [T]
int64 with slot = page_id * page_size + offset_in_page, negative for padding tokens that must
not be written. One program copies all heads of one token.
"""

import torch

from minispec.kernels._checks import check, check_dense, check_same_device, should_validate
from minispec.kernels._triton import tl, triton


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt, stride_kh,  # the D stride of every tensor is 1
    stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch,  # k_cache: page, slot in page, head
    stride_vcp, stride_vcs, stride_vch,
    page_size,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot < 0:  # padding token
        return
    page = slot // page_size
    offset = slot % page_size
    offs_h = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    head_in = offs_h[:, None] < NUM_KV_HEADS  # [HEADS_PAD, 1]

    # [HEADS_PAD, D]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=head_in)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=head_in)
    tl.store(k_cache_ptr + page * stride_kcp + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k, mask=head_in)
    tl.store(v_cache_ptr + page * stride_vcp + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v, mask=head_in)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    validate: bool | None = None,
) -> None:
    """Write k[t], v[t] into cache slot slot_mapping[t] (skip slot < 0); returns nothing.

    validate checks that every slot is inside the pool, which syncs with the device; None means
    "unless capturing a CUDA graph" (shape and dtype checks always run).
    """
    _check_write_args(k, v, k_cache, v_cache, slot_mapping, validate)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_mapping_ptr=slot_mapping,
        stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_kcp=k_cache.stride(0), stride_kcs=k_cache.stride(1), stride_kch=k_cache.stride(2),
        stride_vcp=v_cache.stride(0), stride_vcs=v_cache.stride(1), stride_vch=v_cache.stride(2),
        page_size=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        num_warps=1,
    )


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    validate: bool | None = None,
) -> None:
    """Plain-torch twin of `write_kv`: one index_copy_ per cache (slots < 0 are skipped)."""
    _check_write_args(k, v, k_cache, v_cache, slot_mapping, validate)
    keep = slot_mapping >= 0  # [T]
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]  # [T_kept, ...]
    num_kv_heads, head_dim = k.shape[1:]
    # Slot s is row s of the pool seen as [num_pages * page_size, Hkv, D] (a view: view() refuses
    # a pool it cannot reinterpret in place, so a write can never land in a copy).
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _check_write_args(k, v, k_cache, v_cache, slot_mapping, validate) -> None:
    """Checks shared by the kernel and its reference; the value check only when validating."""
    check(k.dim() == 3 and k.shape == v.shape,
          lambda: f"k and v must both be [T, Hkv, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          lambda: f"k_cache and v_cache must both be [num_pages, page_size, Hkv, D]; "
          f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    num_pages, page_size = k_cache.shape[:2]
    check(k_cache.shape[2:] == (num_kv_heads, head_dim),
          lambda: f"cache heads/head_dim {tuple(k_cache.shape[2:])} differ from k's {(num_kv_heads, head_dim)}")
    check(head_dim >= 1 and head_dim & (head_dim - 1) == 0, lambda: f"head_dim must be a power of two, got {head_dim}")
    check(k.dtype == v.dtype == k_cache.dtype == v_cache.dtype,
          lambda: f"dtypes differ: k {k.dtype}, v {v.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,),
          lambda: f"slot_mapping must be int64 [T={num_tokens}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_dense(slot_mapping=slot_mapping)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check(t.stride(-1) == 1, lambda: f"{name} must be contiguous in its last (head_dim) dimension")
    validate = should_validate(validate, k)
    if validate and num_tokens > 0:
        check(int(slot_mapping.max()) < num_pages * page_size,
              lambda: f"slot {int(slot_mapping.max())} is outside the pool of {num_pages} pages x {page_size} slots")
