"""RoPE on the new queries and keys, fused with the write of the new keys and values into the
paged KV cache: one launch where the model ran a rotation per tensor and a cache write.

    out[t, h]  = qk[t, h] * cos[t] + roll(qk[t, h]) * sin_signed[t]          for every head h
    k_cache[slot // page_size, slot % page_size] = out[t, Hq:]               slot = slot_mapping[t] >= 0
    v_cache[slot // page_size, slot % page_size] = v[t]

RoPE in the Hugging Face / GPT-NeoX layout (rotate_half: the two halves of D pair up), written as
x * cos + roll(x) * sin_signed with roll([x1, x2]) = [x2, x1] and sin_signed = [-sin, sin]
(minispec/model/llama.py, `rope_tables` and `apply_rope`).

Shapes: qk [T, Hq + Hkv, D], the query heads then the key heads (the first part of the fused QKV
projection's output: any row and head strides); v [T, Hkv, D]; cos, sin_signed [T, 1, D] in the
tensors' dtype; k_cache, v_cache [num_pages, page_size, Hkv, D]; slot_mapping [T] int64 (slot =
page * page_size + offset; negative for padding tokens, which are rotated but not written).
Returns the rotated heads as a new contiguous [T, Hq + Hkv, D]. Without a cache (a cache-free
prefill) it only rotates.

Why the cos / sin tables rather than positions and inv_freq: the model builds them once per
forward (not per layer), and reading the same dtype-rounded table lets the kernel round exactly as
the torch twin does (each product rounded to the dtype, then the sum), so the two agree bit for
bit in every dtype. One program handles one (token, head): D elements. The head counts are
runtime arguments, not constexprs, so one compiled kernel per (dtype, D) serves every model.
"""

import torch

from minispec.kernels._checks import check, check_dense, check_head_dim, check_same_device, should_validate
from minispec.kernels._rounding import round_to
from minispec.kernels._triton import tl, triton
from minispec.kernels.kv_write import write_kv_ref


@triton.jit
def _rope_write_kernel(
    qk_ptr,  # [T, Hq + Hkv, D]
    v_ptr,  # [T, Hkv, D]
    cos_ptr,  # [T, 1, D]
    sin_ptr,  # [T, 1, D], signed: [-sin, sin]
    out_ptr,  # [T, Hq + Hkv, D] contiguous
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_qkt, stride_qkh,  # the D stride of every tensor is 1
    stride_vt, stride_vh,
    stride_ct,  # cos and sin share their strides
    stride_kcp, stride_kcs, stride_kch,  # k_cache: page, slot in page, head
    stride_vcp, stride_vcs, stride_vch,
    page_size,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HAS_CACHE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..Hq + Hkv - 1: a query head, then the key heads
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    offs_rolled = (offs_d + HEAD_DIM // 2) % HEAD_DIM  # [D]: roll by D/2 pairs the halves
    row = qk_ptr + token * stride_qkt + head * stride_qkh
    x = tl.load(row + offs_d)  # [D]
    x_rolled = tl.load(row + offs_rolled)  # [D]
    cos = tl.load(cos_ptr + token * stride_ct + offs_d)  # [D]
    sin = tl.load(sin_ptr + token * stride_ct + offs_d)  # [D]
    # Each product rounded to the dtype, then the sum: the rounding of the twin's three torch ops.
    dtype = out_ptr.dtype.element_ty
    a = round_to(x.to(tl.float32) * cos.to(tl.float32), dtype)
    b = round_to(x_rolled.to(tl.float32) * sin.to(tl.float32), dtype)
    rotated = round_to(a.to(tl.float32) + b.to(tl.float32), dtype)  # [D]
    tl.store(out_ptr + (token * (num_q_heads + num_kv_heads) + head) * HEAD_DIM + offs_d, rotated)
    if HAS_CACHE:
        slot = tl.load(slot_mapping_ptr + token)  # int64
        if slot >= 0:  # (negative: a padding token)
            page = slot // page_size
            offset = slot % page_size
            if head >= num_q_heads:  # a key head: its rotated key into the pool
                kv_head = head - num_q_heads
                tl.store(k_cache_ptr + page * stride_kcp + offset * stride_kcs + kv_head * stride_kch + offs_d,
                         rotated)
            if head < num_kv_heads:  # the first Hkv programs also copy one value head each
                value = tl.load(v_ptr + token * stride_vt + head * stride_vh + offs_d)  # [D]
                tl.store(v_cache_ptr + page * stride_vcp + offset * stride_vcs + head * stride_vch + offs_d,
                         value)


def rope_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Rotate qk [T, Hq + Hkv, D] (returned as a new contiguous tensor) and write its key heads and
    v into the cache at slot_mapping (module docstring); the caches and slot_mapping may be None
    (all three) to rotate only. validate checks that every slot is inside the pool (a device
    sync); None means "unless capturing a CUDA graph"."""
    _check_args(qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, validate)
    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)  # [T, Hq + Hkv, D]
    if num_tokens == 0:
        return out
    has_cache = k_cache is not None
    k_cache = k_cache if has_cache else out  # unread without a cache; any tensor will do
    v_cache = v_cache if has_cache else out
    _rope_write_kernel[(num_tokens, num_heads)](
        qk_ptr=qk, v_ptr=v, cos_ptr=cos, sin_ptr=sin_signed, out_ptr=out,
        k_cache_ptr=k_cache, v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping if has_cache else cos,
        stride_qkt=qk.stride(0), stride_qkh=qk.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_ct=cos.stride(0),
        stride_kcp=k_cache.stride(0), stride_kcs=k_cache.stride(1), stride_kch=k_cache.stride(-2),
        stride_vcp=v_cache.stride(0), stride_vcs=v_cache.stride(1), stride_vch=v_cache.stride(-2),
        page_size=k_cache.shape[1] if has_cache else 1,
        num_q_heads=num_heads - num_kv_heads, num_kv_heads=num_kv_heads, HEAD_DIM=head_dim,
        HAS_CACHE=has_cache, num_warps=1,
    )
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF / GPT-NeoX layout: x * cos + rotate_half(x) * sin, where
    rotate_half([x1, x2]) = [-x2, x1] on the last axis. Written as x * cos + roll(x) * sin_signed
    with roll([x1, x2]) = [x2, x1] and sin_signed = [-sin, sin] (the same products, fewer ops).
    x: [T, H, D] (any strides); cos, sin_signed: [T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def rope_write_ref(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `rope_write`: `apply_rope` on all heads at once, then `write_kv_ref`
    of the rotated key heads and v (slots < 0 skipped)."""
    _check_args(qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, validate)
    out = apply_rope(qk, cos, sin_signed)  # [T, Hq + Hkv, D]
    if k_cache is not None:
        write_kv_ref(out[:, qk.shape[1] - v.shape[1]:], v, k_cache, v_cache, slot_mapping, validate=False)
    return out


def _check_args(qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, validate) -> None:
    """Checks shared by the kernel and its twin; the slot value check only when validating."""
    check(qk.dim() == 3 and v.dim() == 3, lambda: f"qk must be [T, Hq + Hkv, D] and v [T, Hkv, D]; "
          f"got {tuple(qk.shape)} and {tuple(v.shape)}")
    num_tokens, num_heads, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    check(v.shape[0] == num_tokens and v.shape[2] == head_dim and 0 < num_kv_heads < num_heads,
          lambda: f"v {tuple(v.shape)} must be [T={num_tokens}, Hkv, D={head_dim}] with Hkv < {num_heads} "
          "(qk holds the query heads, then the Hkv key heads)")
    check_head_dim(head_dim)
    check(cos.shape == sin_signed.shape == (num_tokens, 1, head_dim),
          lambda: f"cos and sin_signed must be [T={num_tokens}, 1, D={head_dim}]; "
          f"got {tuple(cos.shape)} and {tuple(sin_signed.shape)}")
    check(cos.stride() == sin_signed.stride(), "cos and sin_signed must have the same strides")
    check(qk.dtype == v.dtype == cos.dtype == sin_signed.dtype,
          lambda: f"dtypes differ: qk {qk.dtype}, v {v.dtype}, cos {cos.dtype}, sin_signed {sin_signed.dtype}")
    check(qk.dtype in (torch.float16, torch.bfloat16, torch.float32), lambda: f"unsupported dtype {qk.dtype}")
    for name, t in (("qk", qk), ("v", v), ("cos", cos), ("sin_signed", sin_signed)):
        check(t.stride(-1) == 1, lambda: f"{name} must be contiguous in its last (head_dim) dimension")
    check_same_device(qk=qk, v=v, cos=cos, sin_signed=sin_signed)
    caches = (k_cache, v_cache, slot_mapping)
    check(all(c is None for c in caches) or all(c is not None for c in caches),
          "pass k_cache, v_cache and slot_mapping together (or none of them)")
    if k_cache is None:
        return
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim),
          lambda: f"k_cache and v_cache must both be [num_pages, page_size, Hkv={num_kv_heads}, D={head_dim}]; "
          f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check(k_cache.dtype == v_cache.dtype == qk.dtype,
          lambda: f"cache dtypes {k_cache.dtype}, {v_cache.dtype} differ from qk's {qk.dtype}")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the caches must be contiguous in head_dim")
    check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,),
          lambda: f"slot_mapping must be int64 [T={num_tokens}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    check_dense(slot_mapping=slot_mapping)
    check_same_device(qk=qk, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if should_validate(validate, qk) and num_tokens > 0:
        capacity = k_cache.shape[0] * k_cache.shape[1]
        check(int(slot_mapping.max()) < capacity,
              lambda: f"slot {int(slot_mapping.max())} is outside the pool of {capacity} slots")
