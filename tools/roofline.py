"""How close a decode step comes to the speed of light, and what eager steps cost on a GPU.

    python tools/roofline.py --target DIR_OR_GGUF --json OUT.json [--tokens 128] [--requests 32]

1. Ceilings of this device, measured: copy bandwidth (a 1 GiB bf16 tensor copied, bytes read and
   written / time) and bf16 GEMM throughput (8192^3).
2. The speed of light of a decode step at batch 1: every weight byte is read once per step, so
   TPOT >= weight bytes / copy bandwidth. The launch-bound estimate: the kernels one eager decode
   forward launches (counted with the profiler) x the time of one small launch. Measured TPOT
   at batch 1 of plain decoding with CUDA graphs and without, set against both.
3. Continuous batching: `requests` requests of mixed lengths through max_num_seqs 16, so finished
   requests make room for new ones mid-run. Every target forward is timed and counted by path:
   a replayed CUDA graph, the static layout run eagerly, or the dynamic path (prompts, and steps
   that admit a request). The dynamic steps' share of the time is what eager steps cost.

On a CPU (tools/gpu_check.sh --dry-run) it runs the same code at tiny sizes without the GPU
measurements, so the script cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, device: torch.device, repeats: int = 10) -> float:
    """Seconds per call of fn (best of `repeats`, after one warm-up), the device's work included."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (bytes/s) and bf16 GEMM throughput (flop/s) of this device."""
    size = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device)
    n = 8192 if device.type == "cuda" else 256
    a, b = (torch.randn(n, n, device=device).to(torch.bfloat16) for _ in range(2))
    gemm_s = timed(lambda: a @ b, device)
    return {"copy_bytes_per_s": 2 * size / copy_s, "bf16_flop_per_s": 2 * n**3 / gemm_s}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters and buffers (a tied head counted once)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def launch_estimate(llm, device: torch.device) -> dict:
    """Kernels launched by one eager decode forward at batch 1, and the time of one small launch."""
    if device.type != "cuda":
        return {"kernels_per_decode": None, "launch_s": None}
    from torch.profiler import ProfilerActivity, profile

    from minispec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    runner = llm.engine.target
    static, runner.static = runner.static, None  # eager: every kernel launched by the host
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([[1, 2, 3, 4]], params)  # one prefill, one decode
    finally:
        runner.static = static
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    x = torch.zeros(1, device=device)
    launch_s = timed(lambda: [x.add_(1) for _ in range(1000)], device) / 1000
    return {"kernels_per_decode": kernels / 2, "launch_s": launch_s}  # (prefill and decode launch alike)


def batch1_tpot(target, device: torch.device, tokens: int, graphs: bool) -> float:
    from minispec import LLM, SamplingParams

    llm = LLM(model=target, cuda_graphs=graphs if device.type == "cuda" else None,
              static_shapes=None if device.type == "cuda" else graphs, kv_cache_gib=0.25)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)  # warm-up
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)
    return llm.last_metrics.summary()["mean_tpot_ms"] / 1e3


def continuous_batching(target, device: torch.device, requests: int, tokens: int) -> dict:
    """Forward counts and seconds by path over a run where requests join and leave the batch."""
    from minispec import LLM, SamplingParams

    llm = LLM(model=target, max_num_seqs=16, static_shapes=True if device.type != "cuda" else None, kv_cache_gib=0.5)
    runner = llm.engine.target
    seconds = {"graph": 0.0, "static": 0.0, "dynamic": 0.0}
    forward = runner.forward

    def timed_forward(feeds, **kwargs):
        before = dict(runner.forward_counts)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = forward(feeds, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        kind = next(k for k in seconds if runner.forward_counts[k] != before[k])
        seconds[kind] += time.perf_counter() - start
        return out

    runner.forward = timed_forward
    prompts = [[(7 * i + j) % 200 + 1 for j in range(8 + i % 24)] for i in range(requests)]
    params = [SamplingParams(temperature=0, max_tokens=max(2, tokens * (1 + i % 4) // 4), ignore_eos=True)
              for i in range(requests)]
    for counts in runner.forward_counts:
        runner.forward_counts[counts] = 0
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    counts = dict(runner.forward_counts)
    return {"requests": requests, "forwards": counts, "seconds": seconds, "wall_s": wall,
            "dynamic_share_of_forward_time": seconds["dynamic"] / max(sum(seconds.values()), 1e-9)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from minispec import LLM, load_checkpoint

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_checkpoint(args.target, dtype=dtype, device=device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype)}
    out["ceilings"] = measure_ceilings(device)
    out["weight_bytes"] = weight_bytes(target[0])
    out["speed_of_light_tpot_s"] = out["weight_bytes"] / out["ceilings"]["copy_bytes_per_s"]
    out.update(launch_estimate(LLM(model=target, kv_cache_gib=0.25), device))
    if out["kernels_per_decode"]:
        out["launch_bound_tpot_s"] = out["kernels_per_decode"] * out["launch_s"]
    out["tpot_s"] = {"graphs": batch1_tpot(target, device, args.tokens, True),
                     "eager": batch1_tpot(target, device, args.tokens, False)}
    out["continuous_batching"] = continuous_batching(target, device, args.requests, args.tokens)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    sol, tpot, cb = out["speed_of_light_tpot_s"], out["tpot_s"], out["continuous_batching"]
    print(f"roofline on {out['device']}: copy {out['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {out['ceilings']['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s; weights {out['weight_bytes'] / 2**20:.0f} MiB")
    print(f"  batch-1 TPOT: graphs {tpot['graphs'] * 1e3:.3f} ms, eager {tpot['eager'] * 1e3:.3f} ms; speed of light "
          f"{sol * 1e3:.3f} ms ({sol / tpot['graphs']:.0%} of the graphs' TPOT)"
          + (f"; launch-bound {out['launch_bound_tpot_s'] * 1e3:.3f} ms ({out['kernels_per_decode']:.0f} kernels x "
             f"{out['launch_s'] * 1e6:.1f} us)" if out.get("launch_bound_tpot_s") else ""))
    print(f"  continuous batching, {cb['requests']} requests: forwards {cb['forwards']}, dynamic share of forward time "
          f"{cb['dynamic_share_of_forward_time']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
