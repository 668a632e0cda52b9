"""Check the Triton kernels on a GPU against their torch twins, then time them next to SDPA.

    python tools/bench_kernels.py [--check-only]      (bench.py --kernels calls main())

1. Correctness in bf16 and fp16: flash_prefill, paged_attention (decode, k+1 verification and
   prefill chunks in one batch; split-KV forced on and off) and write_kv, printing the max abs
   error to the fp32 reference.
2. Prefill: TFLOP/s of flash_prefill at 512..4096 tokens per sequence (4 sequences, 32 query
   heads, 8 kv heads, head_dim 128) next to torch SDPA(is_causal=True). Causal FLOPs are
   counted as 2 matmuls x 2 flops x B x Hq x D x L^2 / 2.
3. Decode: achieved bandwidth of paged_attention (bytes of K and V read / time) at contexts
   1k, 4k, 16k and batch 16 and 64, next to SDPA on a contiguous [B, Hkv, L, D] cache. For one
   query token grouped-query attention equals SDPA with the group of query heads as the query
   length of each kv head, which keeps SDPA on its fast kernels without copying K/V.
4. Verification: time of q_len = 5 (4 drafts + 1) next to decode at the same context.
5. The shapes the default pair launches (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64):
   decode and k=4 verification at batch 1 and 16, prefill of one prompt.
Every throughput is also given as a share of this device's measured ceilings (copy bandwidth and
bf16 GEMM, tools/roofline.py), the roofline a kernel is judged against.

Without a GPU it says so and exits 0 (with --cpu-check after a tiny check under the interpreter).
Timings use CUDA events after warm-up. Returns 1 if a correctness check failed.
"""

import argparse
import math
import traceback

import torch
from roofline import measure_ceilings

from minispec.kernels.flash_prefill import flash_prefill, flash_prefill_ref
from minispec.kernels.kv_write import write_kv, write_kv_ref
from minispec.kernels.paged_attention import (
    default_num_splits,
    default_paged_tiles,
    paged_attention,
    paged_attention_ref,
)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # max abs error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true", help="correctness checks, no timings")
    parser.add_argument("--cpu-check", action="store_true",
                        help="without a GPU, run a tiny check under the Triton interpreter (~1 minute)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU; nothing timed" + (
            ", tiny check under the Triton interpreter:" if args.cpu_check else " (--cpu-check runs a tiny check)"))
        if args.cpu_check:
            ok = check_all(torch.device("cpu"), dtypes=(torch.float32, torch.float16), tiny=True)
            print("bench_kernels: interpreter check", "passed" if ok else "FAILED")
        return 0

    device = torch.device("cuda")
    print(f"bench_kernels on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    ok = check_all(device, dtypes=(torch.bfloat16, torch.float16), tiny=False)
    if not args.check_only:
        ceilings = measure_ceilings(device)
        print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM "
              f"{ceilings['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s")
        for section in (bench_prefill, bench_decode, bench_verification, bench_real_shapes):
            ok &= _run_section(section.__name__, lambda: section(device, ceilings))
    print("bench_kernels:", "all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


# --------------------------------------------------------------------------- correctness


def check_all(device: torch.device, *, dtypes, tiny: bool) -> bool:
    ok = True
    for dtype in dtypes:
        ok &= _run_section(f"prefill {dtype}", lambda: _check_prefill(device, dtype, tiny))
        ok &= _run_section(f"paged {dtype}", lambda: _check_paged(device, dtype, tiny))
        ok &= _run_section(f"write_kv {dtype}", lambda: _check_write_kv(device, dtype))
    return ok


def _report(name: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> bool:
    error = (actual.float() - expected.float()).abs().max().item()
    ok = error <= TOLERANCE[dtype] and not math.isnan(error)
    print(f"  {name:<58} {str(dtype):<15} max abs err {error:.2e}  {'ok' if ok else 'FAIL'}")
    return ok


def _check_prefill(device, dtype, tiny) -> bool:
    seq_lens = [1, 9, 40] if tiny else [1, 100, 257, 1000]
    shapes = [(4, 2, 32)] if tiny else [(32, 8, 128), (8, 8, 64), (4, 1, 256)]
    ok = True
    for num_q_heads, num_kv_heads, head_dim in shapes:
        q, k, v, cu_seqlens = packed_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, dtype, device)
        for window in (None, 7 if tiny else 128):
            kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window)
            out = flash_prefill(q, k, v, cu_seqlens, max(seq_lens), **kwargs)
            expected = flash_prefill_ref(q, k, v, cu_seqlens, max(seq_lens), **kwargs)
            ok &= _report(f"flash_prefill Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} W={window}",
                          dtype, out, expected)
    return ok


def _check_paged(device, dtype, tiny) -> bool:
    # decode, verification, a prefill chunk after context, a whole prompt
    seq_lens, q_lens = ([1, 30, 40, 9], [1, 5, 16, 9]) if tiny else ([1, 1000, 4097, 300], [1, 5, 64, 300])
    shapes = [(4, 2, 32)] if tiny else [(32, 8, 128), (8, 8, 64), (4, 1, 256)]
    ok = True
    for num_q_heads, num_kv_heads, head_dim in shapes:
        args = paged_batch(seq_lens, q_lens, 16, num_q_heads, num_kv_heads, head_dim, dtype, device)
        for window in (None, 7 if tiny else 256):
            kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window)
            expected = paged_attention_ref(*args, **kwargs)
            for num_splits in (None, 1, 4):
                out = paged_attention(*args, **kwargs, num_splits=num_splits)
                ok &= _report(f"paged_attention Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} "
                              f"W={window} splits={num_splits}", dtype, out, expected)
    return ok


def _check_write_kv(device, dtype) -> bool:
    num_tokens, num_kv_heads, head_dim, page_size, num_pages = 37, 8, 128, 16, 64
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)  # [T, Hkv, D]
    v = torch.randn_like(k)
    slots = torch.randperm(num_pages * page_size, device=device)[:num_tokens]  # [T] int64
    slots[::5] = -1
    k_cache = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    return _report("write_kv (must be bit-exact)", dtype, torch.cat([k_cache, v_cache]), torch.cat([k_ref, v_ref]))


# --------------------------------------------------------------------------- inputs


def packed_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, dtype, device):
    """Random q [T, Hq, D], k, v [T, Hkv, D] and cu_seqlens [B+1] int32."""
    num_tokens = sum(seq_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    cu_seqlens = torch.tensor([0, *_cumsum(seq_lens)], dtype=torch.int32, device=device)  # [B+1]
    return q, k, v, cu_seqlens


def paged_batch(seq_lens, q_lens, page_size, num_q_heads, num_kv_heads, head_dim, dtype, device):
    """The positional arguments of paged_attention for random sequences in shuffled pages."""
    max_pages = math.ceil(max(seq_lens) / page_size)
    num_pages = len(seq_lens) * max_pages + 7  # a few spare pages
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device=device).to(dtype)  # [P, page_size, Hkv, D]
    v_cache = torch.randn(cache_shape, device=device).to(dtype)
    block_tables = torch.randperm(num_pages, device=device)[: len(seq_lens) * max_pages]
    block_tables = block_tables.view(len(seq_lens), max_pages).to(torch.int32)  # [B, max_pages]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=device).to(dtype)  # [T, Hq, D]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)  # [B]
    query_start_loc = torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32, device=device)  # [B+1]
    return q, k_cache, v_cache, block_tables, seq_lens_t, query_start_loc, max(q_lens), max(seq_lens)


def _cumsum(values):
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


# --------------------------------------------------------------------------- timings


def time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    """Mean milliseconds per call, measured with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_prefill(device, ceilings: dict) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    num_seqs, num_q_heads, num_kv_heads, head_dim = 4, 32, 8, 128
    print(f"prefill: {num_seqs} sequences, Hq={num_q_heads}, Hkv={num_kv_heads}, D={head_dim}, bf16, causal")
    print(f"  {'seq len':>8} {'flash_prefill ms':>17} {'TFLOP/s':>8} {'of GEMM':>8} {'SDPA ms':>9} {'TFLOP/s':>8}")
    for seq_len in (512, 1024, 2048, 4096):
        q, k, v, cu_seqlens = packed_batch([seq_len] * num_seqs, num_q_heads, num_kv_heads, head_dim,
                                           torch.bfloat16, device)
        flops = 2 * 2 * num_seqs * num_q_heads * head_dim * seq_len * seq_len / 2
        ours = time_ms(lambda: flash_prefill(q, k, v, cu_seqlens, seq_len, sm_scale=head_dim**-0.5, validate=False))
        # SDPA layout [B, H, L, D]; K/V expanded to all query heads once, outside the timing.
        group = num_q_heads // num_kv_heads
        q_b = q.view(num_seqs, seq_len, num_q_heads, head_dim).transpose(1, 2)
        k_b = k.view(num_seqs, seq_len, num_kv_heads, head_dim).transpose(1, 2).repeat_interleave(group, 1)
        v_b = v.view(num_seqs, seq_len, num_kv_heads, head_dim).transpose(1, 2).repeat_interleave(group, 1)
        theirs = time_ms(lambda: sdpa(q_b, k_b, v_b, is_causal=True))
        share = flops / ours * 1e3 / ceilings["bf16_flop_per_s"]
        print(f"  {seq_len:>8} {ours:>17.3f} {flops / ours / 1e9:>8.1f} {share:>8.0%} {theirs:>9.3f} {flops / theirs / 1e9:>8.1f}")
        del q, k, v, k_b, v_b


def bench_decode(device, ceilings: dict) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    num_q_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    group = num_q_heads // num_kv_heads
    print(f"decode: q_len 1, Hq={num_q_heads}, Hkv={num_kv_heads}, D={head_dim}, page {page_size}, bf16")
    print(f"  {'batch':>5} {'context':>8} {'splits':>6} {'paged ms':>9} {'GB/s':>7} {'of copy':>8} {'SDPA ms':>8} {'GB/s':>7}")
    for num_seqs in (16, 64):
        for context in (1024, 4096, 16384):
            args = paged_batch([context] * num_seqs, [1] * num_seqs, page_size, num_q_heads, num_kv_heads,
                               head_dim, torch.bfloat16, device)
            gbytes = 2 * num_seqs * context * num_kv_heads * head_dim * 2 / 1e9  # K and V, 2 bytes each
            ours = time_ms(lambda: paged_attention(*args, sm_scale=head_dim**-0.5, validate=False))
            _, block_n, _ = default_paged_tiles(head_dim, 1, group)
            splits = default_num_splits(num_seqs * num_kv_heads, context, block_n, device)
            # Contiguous cache for SDPA: [B, Hkv, L, D]; the group's query heads act as its queries.
            q = args[0].view(num_seqs, num_kv_heads, group, head_dim)
            k = torch.randn(num_seqs, num_kv_heads, context, head_dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            theirs = time_ms(lambda: sdpa(q, k, v))
            share = gbytes * 1e12 / ours / ceilings["copy_bytes_per_s"]
            print(f"  {num_seqs:>5} {context:>8} {splits:>6} {ours:>9.3f} {gbytes / ours * 1e3:>7.0f} {share:>8.0%} "
                  f"{theirs:>8.3f} {gbytes / theirs * 1e3:>7.0f}")
            del args, k, v


def bench_verification(device, ceilings: dict) -> None:
    num_q_heads, num_kv_heads, head_dim, page_size, num_seqs = 32, 8, 128, 16, 32
    print(f"verification: {num_seqs} sequences, q_len 5 (4 drafts + 1) vs q_len 1, bf16")
    print(f"  {'context':>8} {'decode ms':>10} {'verify ms':>10} {'verify/decode':>14}")
    for context in (1024, 4096, 16384):
        timings = []
        for q_len in (1, 5):
            args = paged_batch([context] * num_seqs, [q_len] * num_seqs, page_size, num_q_heads, num_kv_heads,
                               head_dim, torch.bfloat16, device)
            timings.append(time_ms(lambda: paged_attention(*args, sm_scale=head_dim**-0.5, validate=False)))
            del args
        print(f"  {context:>8} {timings[0]:>10.3f} {timings[1]:>10.3f} {timings[1] / timings[0]:>14.2f}")


def bench_real_shapes(device, ceilings: dict) -> None:
    """The attention launches of the default pair (SmolLM2-135M: Hq 9, Hkv 3, D 64), per layer."""
    num_q_heads, num_kv_heads, head_dim, page_size = 9, 3, 64, 16
    print(f"default pair's shapes: Hq={num_q_heads}, Hkv={num_kv_heads}, D={head_dim}, page {page_size}, bf16, per layer")
    print(f"  {'kind':>12} {'batch':>5} {'context':>8} {'ms':>8} {'GB/s':>7} {'of copy':>8}")
    for q_len, kind in ((1, "decode"), (5, "verify k=4")):
        for num_seqs in (1, 16):
            for context in (256, 1024):
                args = paged_batch([context] * num_seqs, [q_len] * num_seqs, page_size, num_q_heads, num_kv_heads,
                                   head_dim, torch.bfloat16, device)
                gbytes = 2 * num_seqs * context * num_kv_heads * head_dim * 2 / 1e9
                ms = time_ms(lambda: paged_attention(*args, sm_scale=head_dim**-0.5, validate=False))
                share = gbytes * 1e12 / ms / ceilings["copy_bytes_per_s"]
                print(f"  {kind:>12} {num_seqs:>5} {context:>8} {ms:>8.4f} {gbytes / ms * 1e3:>7.0f} {share:>8.0%}")
                del args
    for seq_len in (128, 512):
        q, k, v, cu_seqlens = packed_batch([seq_len], num_q_heads, num_kv_heads, head_dim, torch.bfloat16, device)
        flops = 2 * 2 * num_q_heads * head_dim * seq_len * seq_len / 2
        ms = time_ms(lambda: flash_prefill(q, k, v, cu_seqlens, seq_len, sm_scale=head_dim**-0.5, validate=False))
        print(f"  {'prefill':>12} {1:>5} {seq_len:>8} {ms:>8.4f} {flops / ms / 1e9:>6.2f}T {flops / ms * 1e3 / ceilings['bf16_flop_per_s']:>8.1%}"
              " (of GEMM)")


def _run_section(name: str, fn) -> bool:
    """Run one check or benchmark; a crash is printed and counted as a failure, not fatal."""
    try:
        result = fn()
    except Exception:  # report and go on: one broken section should not hide the others
        print(f"  {name}: ERROR")
        traceback.print_exc()
        return False
    return result is not False


if __name__ == "__main__":
    raise SystemExit(main())
