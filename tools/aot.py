"""Every kernel compiled ahead of time for NVIDIA GPUs that are not here, with its resource usage.

How: each launcher (`paged_attention`, `flash_prefill`, `write_kv`, and the fused layer kernels
`add_rmsnorm`, `rope_write`, `silu_mul`) is called on small CPU tensors
of a configuration's shapes, with its Triton kernels swapped for recorders, so what gets compiled
is exactly what the launcher would launch: its constexprs (tile sizes, split count, precision), its
num_warps, its argument types and the JIT's own specialization of their values (ints equal to 1
as constants, divisibility-by-16 hints). Each launch is compiled with
`triton.compile(..., target=GPUTarget("cuda", arch, 32))` (Triton bundles ptxas), and the cubin is
read with the bundled `cuobjdump -res-usage`: registers per thread, STACK (bytes of local memory
per thread: register spills when > 0), static SHARED, and Triton's dynamic shared memory, checked
against the architecture's limit. Results are cached per (kernel sources, Triton version, config).

Needs a process with TRITON_INTERPRET=0 set before Triton is imported (the interpreter is chosen at
import): `TRITON_INTERPRET=0 python tools/aot.py [--all] [--arch 80,90]` prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# Shared memory a block may use (opt-in maximum): A100 (sm_80) 163 KiB, H100/H200 (sm_90) 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}
KERNEL_FILES = ("paged_attention.py", "flash_prefill.py", "kv_write.py", "add_rmsnorm.py", "rope_write.py",
                "silu_mul.py", "_rounding.py", "_checks.py")
CACHE = Path(os.environ.get("MINISPEC_AOT_CACHE", Path.home() / ".cache" / "minispec" / "aot.json"))


@dataclass(frozen=True)
class Config:
    """One launch the engine can make: which launcher, dtype, head_dim, query heads per kv head,
    new tokens per sequence (1: decode, k+1: verification; prefill: a prompt), forced splits;
    width: the row length of the fused layer kernels (hidden size for add_rmsnorm, intermediate
    size for silu_mul)."""

    launcher: str  # "paged_attention" | "flash_prefill" | "write_kv" | "add_rmsnorm" | "rope_write" | "silu_mul"
    dtype: str  # "float16" | "bfloat16" | "float32"
    head_dim: int
    group: int = 1
    query_len: int = 1
    num_splits: int = 1
    tree: bool = False  # a tree verification: the last query_len - 1 new tokens under a tree mask
    width: int = 0

    def label(self) -> str:
        if self.launcher == "add_rmsnorm":
            return f"add_rmsnorm {self.dtype} H={self.width}"
        if self.launcher == "silu_mul":
            return f"silu_mul {self.dtype} I={self.width}"
        tree = " tree" if self.tree else ""
        extra = {"paged_attention": f" group {self.group} q_len {self.query_len} splits {self.num_splits}{tree}",
                 "flash_prefill": f" group {self.group}", "write_kv": "", "rope_write": ""}
        return f"{self.launcher} {self.dtype} D={self.head_dim}{extra[self.launcher]}"


@dataclass
class Result:
    kernel: str
    config: str
    arch: int
    num_warps: int
    constexprs: str
    registers: int
    stack: int  # bytes per thread of local memory: > 0 means register spills
    local: int
    shared: int  # static + dynamic shared memory in bytes
    shared_ok: bool

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](**kwargs)` records the launch."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append((self.fn, kwargs))


def launches(config: Config) -> list[tuple]:
    """(kernel, launch kwargs) that the launcher makes for config, on CPU tensors."""
    from minispec.kernels import add_rmsnorm, rope_write, silu_mul
    from minispec.kernels import flash_prefill as fp
    from minispec.kernels import kv_write as kw
    from minispec.kernels import paged_attention as pa

    module = {"paged_attention": pa, "flash_prefill": fp, "write_kv": kw, "add_rmsnorm": add_rmsnorm,
              "rope_write": rope_write, "silu_mul": silu_mul}[config.launcher]
    names = [n for n in vars(module) if n.startswith("_") and n.endswith("_kernel")]
    recorded: list = []
    saved = {n: getattr(module, n) for n in names}
    try:
        for n in names:
            setattr(module, n, _Recorder(saved[n], recorded))
        _call_launcher(module, config)
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)
    return recorded


def _call_launcher(module, c: Config) -> None:
    dtype, d, hkv = getattr(torch, c.dtype), c.head_dim, 2
    hq = hkv * c.group
    if c.launcher == "paged_attention":
        page, pages, seq_len = 16, 64, 1000
        q = torch.zeros(c.query_len, hq, d, dtype=dtype)
        cache = torch.zeros(pages, page, hkv, d, dtype=dtype)
        tables = torch.arange(pages, dtype=torch.int32)[None]  # [1, pages]
        tree = {} if not c.tree else {"tree_start": torch.tensor([seq_len - c.query_len + 1], dtype=torch.int32),
                                      "tree_bits": torch.zeros(c.query_len, dtype=torch.int64)}
        module.paged_attention(q, cache, cache.clone(), tables, torch.tensor([seq_len], dtype=torch.int32),
                               torch.tensor([0, c.query_len], dtype=torch.int32), c.query_len, seq_len,
                               sm_scale=d**-0.5, num_splits=c.num_splits, validate=False, **tree)
    elif c.launcher == "flash_prefill":
        t = c.query_len
        q, k = torch.zeros(t, hq, d, dtype=dtype), torch.zeros(t, hkv, d, dtype=dtype)
        module.flash_prefill(q, k, k.clone(), torch.tensor([0, t], dtype=torch.int32), t, sm_scale=d**-0.5, validate=False)
    elif c.launcher == "write_kv":
        k = torch.zeros(4, hkv, d, dtype=dtype)
        cache = torch.zeros(8, 16, hkv, d, dtype=dtype)
        module.write_kv(k, k.clone(), cache, cache.clone(), torch.arange(4, dtype=torch.int64), validate=False)
    elif c.launcher == "rope_write":  # as the model calls it: q and k heads a strided view of the QKV output
        qkv = torch.zeros(4, (hq + 2 * hkv) * d, dtype=dtype)  # [T, (Hq + 2 Hkv) D]
        qk, v = qkv[:, : (hq + hkv) * d].view(4, hq + hkv, d), qkv[:, (hq + hkv) * d :].view(4, hkv, d)
        cos = torch.zeros(4, 1, d, dtype=dtype)
        cache = torch.zeros(8, 16, hkv, d, dtype=dtype)
        module.rope_write(qk, v, cos, cos.clone(), cache, cache.clone(), torch.arange(4, dtype=torch.int64),
                          validate=False)
    elif c.launcher == "add_rmsnorm":  # the first layer's norm (no residual) and every other one
        x, weight = torch.zeros(4, c.width, dtype=dtype), torch.ones(c.width, dtype=dtype)
        module.add_rmsnorm(x, None, weight, 1e-6)
        module.add_rmsnorm(x, x.clone(), weight, 1e-6)
    else:
        module.silu_mul(torch.zeros(4, 2 * c.width, dtype=dtype))


def signature(fn, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(Triton signature, constexprs, attributes, compile options) of one recorded launch, derived
    as the JIT derives them at launch (Triton's own specialization: ints equal to 1 become
    constants, 16-divisible ints and 16-byte-aligned pointers get divisibility hints)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = kwargs[p.name]
        if p.is_constexpr:
            sig[p.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(CUDABackend, value, p.is_const, not p.do_not_specialize,
                                           not p.do_not_specialize_on_alignment)
        if kind == "constexpr":
            sig[p.name], constexprs[(i,)] = "constexpr", key
        else:
            sig[p.name] = kind
            if key:
                attrs[(i,)] = CUDABackend.parse_attr(key)
    return sig, constexprs, attrs, options


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_launch(fn, kwargs: dict, arch: int, config: Config) -> Result:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs, attrs, options = signature(fn, kwargs)
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage.split(f"Function {fn.__name__}")[-1]))
    shared = int(fields.get("SHARED", 0)) + int(kernel.metadata.shared)
    consts = ", ".join(f"{fn.arg_names[k[0]]}={v}" for k, v in constexprs.items() if sig[fn.arg_names[k[0]]] == "constexpr"
                       and fn.params[k[0]].is_constexpr)
    return Result(fn.__name__, config.label(), arch, options.get("num_warps", 4), consts, int(fields.get("REG", 0)),
                  int(fields.get("STACK", 0)), int(fields.get("LOCAL", 0)), shared, shared <= SHARED_LIMIT.get(arch, 99 * 1024))


def source_hash() -> str:
    import triton

    import minispec.kernels.paged_attention

    kernels = Path(minispec.kernels.paged_attention.__file__).parent
    h = hashlib.sha256(triton.__version__.encode())
    for path in [kernels / name for name in KERNEL_FILES] + [Path(__file__)]:  # (how this file compiles changes the results too)
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def check_config(config: Config, archs: tuple[int, ...]) -> list[Result]:
    """Results for every kernel the config launches, on every arch (from the cache when the
    kernel sources and Triton are unchanged)."""
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    key_prefix = source_hash() + "|" + json.dumps(dataclasses.asdict(config), sort_keys=True)
    results, dirty = [], False
    recorded = None
    for arch in archs:
        key = f"{key_prefix}|{arch}"
        if key not in cache:
            recorded = recorded if recorded is not None else launches(config)
            cache[key] = [dataclasses.asdict(compile_launch(fn, kw, arch, config)) for fn, kw in recorded]
            dirty = True
        results += [Result(**r) for r in cache[key]]
    if dirty:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        fresh = json.loads(CACHE.read_text()) if CACHE.exists() else {}  # another process may have added some
        fresh.update(cache)
        tmp = CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(fresh))
        tmp.replace(CACHE)
    return results


MODELS = {  # (head_dim, query heads per kv head) of the model families the engine targets
    "SmolLM2-135M": (64, 3), "Qwen2.5-0.5B": (64, 7), "Llama-3-8B / Mistral-7B": (128, 4),
    "Qwen2.5-7B": (128, 7), "Llama-2-7B (MHA)": (128, 1),
}
HIDDEN_SIZES = (576, 1536, 4096)  # SmolLM2-135M, Qwen2.5-1.5B, Llama-3-8B: add_rmsnorm's rows
INTERMEDIATE_SIZES = (1536, 8960, 14336)  # the same models' MLPs: silu_mul's rows


def default_configs(all_: bool = False, dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> list[Config]:
    """What the engine launches for the supported models (bf16 / fp16 on GPU; decode, a k = 4
    verification, tree verifications of 8, 16 and 32 nodes, prefill; one split, 4, and the 16
    a batch-1 step on a large GPU gets; the fused layer kernels at the models' widths).
    all_ adds fp32, head dims 16..256,
    every group 1..8 and more query lengths and split counts. dtypes: the half-precision types
    (the suite compiles bf16, what bench and the GPU check launch; by hand, both)."""
    dtypes = list(dtypes) + (["float32"] if all_ else [])
    shapes = sorted(set(MODELS.values())) if not all_ else [(d, g) for d in (16, 32, 64, 128, 256) for g in range(1, 9)]
    configs = []
    for dtype in dtypes:
        for d, g in shapes:
            for q_len in ((1, 5) if not all_ else (1, 2, 5, 9, 17)):
                for splits in ((1, 4, 16) if not all_ else (1, 2, 4, 16)):
                    configs.append(Config("paged_attention", dtype, d, g, q_len, splits))
            for nodes in (8, 16, 32):
                for splits in (1, 16):
                    configs.append(Config("paged_attention", dtype, d, g, nodes + 1, splits, tree=True))
            configs.append(Config("flash_prefill", dtype, d, g, 128))
        for d in sorted({d for d, _ in shapes}):  # (head counts are runtime arguments of these two)
            configs.append(Config("write_kv", dtype, d))
            configs.append(Config("rope_write", dtype, d))
        configs += [Config("add_rmsnorm", dtype, 0, width=h) for h in HIDDEN_SIZES]
        configs += [Config("silu_mul", dtype, 0, width=i) for i in INTERMEDIATE_SIZES]
    return configs


def check_all(configs: list[Config], archs: tuple[int, ...], jobs: int = 1) -> list[Result]:
    """check_config over configs, in `jobs` processes (compiling is single-threaded)."""
    if jobs <= 1:
        return [r for c in configs for r in check_config(c, archs)]
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [r for rs in pool.map(check_config, configs, [archs] * len(configs)) for r in rs]


def table(results: list[Result]) -> str:
    lines = ["| kernel | config | arch | warps | registers | stack (spills) | shared | fits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.kernel} | {r.config} | sm_{r.arch} | {r.num_warps} | {r.registers} | "
                     f"{r.stack}{' SPILLS' if r.spills else ''} | {r.shared} | {'yes' if r.shared_ok else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        print("run with TRITON_INTERPRET=0 (the interpreter cannot compile for a GPU)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every dtype, head dim, group, query length and split count")
    ap.add_argument("--arch", default="80,90", help="compute capabilities (default 80,90)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: all cores)")
    args = ap.parse_args(argv)
    archs = tuple(int(a) for a in args.arch.split(","))
    results = check_all(default_configs(args.all), archs, args.jobs)
    print(table(results))
    bad = [r for r in results if r.spills or not r.shared_ok]
    print(f"\n{len(results)} compiled kernels, {len(bad)} with spills or too much shared memory")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    sys.exit(main())
