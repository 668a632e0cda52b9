"""Measure minispec's step costs on one device at real shapes, predict each drafter's speedup from
them, and check a prediction end to end on a pair whose acceptance is controlled.

    python tools/gpu_measure.py --out DIR [--tiny] [--budget-s 200]

Models are random-init on the device from seeds (tools/random_models.py: SmolLM2-135M with the
shipped draft's and head's shapes, a Qwen2.5-1.5B target with a Qwen2.5-0.5B draft, a
Llama-3.1-8B target with a one-layer EAGLE-3 head). Sections, each written to DIR/gpu_measure.json
and DIR/gpu_measure.md as soon as it is done, in this order (a section that would start past
--budget-s is skipped and said so):

1. The device copy ceiling: a large device-to-device copy, bytes read and written / time
   (tools/roofline.py's measure_ceilings).
2. Per target shape and batch bucket (1 and 16; 1 and 2 with --tiny):
   - forwards through minispec's own ModelRunner, paged KVCache and static shapes (CUDA graphs
     on CUDA, the same layout run eagerly on CPU), every sequence feeding q new tokens over a
     context of `context` cached ones: q = 1 is a decode step, q = k+1 a verification (2..9);
   - the bandwidth of the decode step: bytes it must read (every weight a step reads: all but an
     untied embedding, and the K/V of the context) / its time, as a share of the copy ceiling;
   - the engine end to end (`LLM.generate`, greedy, fixed-length answers): plain decoding's time
     per output token, and for each drafter (the draft model, the EAGLE head's chain, n-gram)
     the time of one drafted position of the batch (drafting time / drafted positions, steps
     that fed a prompt left out);
   - transformers' `generate` on the same device as the peer: a random-init HF model of the same
     config, greedy, the same prompt length and new tokens; its time per token after the first.
3. Predictions (tools/step_model.py): for each drafter whose tokens per step were measured on CPU
   with the real weights (tools/cpu_acceptance.py),
       speedup = E * t_decode / (k * t_draft + t_verify(k+1)),
   with t_decode and t_verify the forwards above and t_draft the engine's drafted position. The
   8B shape's EAGLE head is predicted at 3.1 tokens a step (the issue's bar: >= 2.3x).
4. The controlled pair (tools/controlled_pair.py): a Qwen2.5-0.5B-shaped draft and a target of its
   24 layers plus 72 whose residual writes are scaled by epsilon; for each epsilon, plain and
   speculative decoding (k = 4, batch 1) alternate `repeats` times; measured speedup = median of
   plain TPOT / speculative TPOT; predicted = the step model at the measured tokens per step,
   with the pair's own forward costs and drafted-position time. On a GPU the two should agree
   within 10%; the dry run checks only that every number is computed.

--tiny runs every section at a CPU's size (tools/gpu_check.sh --dry-run), so that the script
cannot rot between GPU sessions; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from controlled_pair import build_pair
from cpu_acceptance import ACCEPTANCE, lookup
from random_models import (HEADS, SHAPES, TINY_VOCAB, VOCAB, hf_config, random_eagle_head, random_transformer,
                           shipped_tokenizer, tiny, tiny_head, tiny_tokenizer)
from roofline import measure_ceilings, timed, weight_bytes
from step_model import acceptance_for, predicted_speedup

# target shape -> its drafters: (name, draft shape or "eagle" or "ngram", k)
DRAFTERS = {
    "qwen2.5-1.5b": [("draft", "qwen2.5-0.5b", 4), ("ngram", "ngram", 4)],
    "llama-3.1-8b": [("eagle", "eagle", 4)],
    "smollm2-135m": [("eagle", "eagle", 4), ("draft", "smollm2-draft", 2), ("ngram", "ngram", 4)],
}
PAIR_SMALL, PAIR_EXTRA, PAIR_K = "qwen2.5-0.5b", 72, 4
EPSILONS = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


@dataclass
class Settings:
    """Sizes and repetitions: the GPU's, or --tiny's (a CPU's)."""

    device: torch.device
    dtype: torch.dtype
    tiny: bool
    buckets: tuple[int, ...]
    q_lens: tuple[int, ...]  # 1 (decode) and the verifications' k+1
    prompt_len: int
    new_tokens: int
    repeats: int  # timed repetitions of a forward (best of), and of the controlled pair's runs (median)
    max_positions: int  # the engine's max_model_len: a static bucket's launch size
    kv_cache_gib: float
    pair_extra: int
    epsilons: tuple[float, ...]

    @property
    def context(self) -> int:
        """Cached tokens under a timed forward: the middle of an engine run's answers."""
        return self.prompt_len + self.new_tokens // 2

    @property
    def graphs(self) -> bool:
        return self.device.type == "cuda"

    def shape(self, name: str) -> dict:
        return tiny(SHAPES[name]) if self.tiny else SHAPES[name]

    def head(self, name: str) -> dict:
        return tiny_head(HEADS[name]) if self.tiny else HEADS[name]

    @property
    def vocab(self) -> int:
        """Prompt ids are drawn below this (every shape's vocabulary covers it)."""
        return TINY_VOCAB if self.tiny else VOCAB

    def tokenizer(self):
        return tiny_tokenizer() if self.tiny else shipped_tokenizer()


def settings(tiny_sizes: bool, device: torch.device) -> Settings:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if tiny_sizes:
        ks = sorted({a.k for a in ACCEPTANCE} | {k for rows in DRAFTERS.values() for *_, k in rows} | {PAIR_K})
        return Settings(device, dtype, True, (1, 2), (1, *(k + 1 for k in ks)), 16, 8, 1, 256, 0.05, 4, (0.0, 0.3))
    return Settings(device, dtype, False, (1, 16), tuple(range(1, 10)), 64, 64, 10, 1024, 1.0, PAIR_EXTRA, EPSILONS)


# ------------------------------------------------------------------------------------ measurements


def forward_costs(model, s: Settings, batches: tuple[int, ...], q_lens: tuple[int, ...]) -> dict:
    """{"seconds": {batch: {q: s}}, "path": graph | static}: one forward of the model's own
    ModelRunner over its paged KVCache with static shapes (graphs on CUDA), each of `batch`
    sequences feeding q tokens (logits for all q, as a verification asks) over s.context cached."""
    from minispec.runtime.kv_cache import BlockTable, KVCache
    from minispec.runtime.runner import Feed, ModelRunner
    from minispec.runtime.static_shapes import StaticShapes

    page = 16
    per_seq = -(-(s.context + max(q_lens)) // page)
    runner = ModelRunner(model, KVCache(model.cfg, max(batches) * per_seq, page, model.dtype, model.device))
    runner.max_positions = min(runner.max_positions, s.max_positions)
    tables = [BlockTable(page) for _ in range(max(batches))]
    for table in tables:
        runner.reserve(table, s.context + max(q_lens))
    seconds = {b: {} for b in batches}
    for q in q_lens:
        runner.static = StaticShapes(runner, q, max(batches))
        runner.static.batches = sorted(batches)  # only the buckets timed
        if s.graphs:
            runner.static.capture()
        for b in batches:
            feeds = [Feed(table, [7] * q, num_logits=q) for table in tables[:b]]  # [b sequences x q tokens]

            def step(feeds=feeds, b=b):
                for table in tables[:b]:
                    table.num_cached = s.context  # every repetition over the same context
                runner.forward(feeds)

            seconds[b][q] = timed(step, s.device, s.repeats)
    path = "graph" if runner.forward_counts["graph"] else "static"
    return {"seconds": seconds, "path": path, "forward_counts": dict(runner.forward_counts)}


def read_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight it uses (an untied embedding only for the rows
    it looks up, so not counted) and the K/V of each sequence's context."""
    from minispec.runtime.kv_cache import KVCache

    weights = weight_bytes(model)
    if not model.cfg.tie_word_embeddings:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return weights + batch * context * KVCache.bytes_per_page(model.cfg, 1, model.dtype)


def prompts(s: Settings, batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, s.vocab, (batch, s.prompt_len), generator=gen).tolist()


def engine_costs(target, tokenizer, drafter, k: int, s: Settings) -> dict:
    """Per bucket, from LLM.generate (greedy, s.new_tokens each): the time per output token, the
    target step's time, tokens per step, and (with a drafter) one drafted position's time."""
    from minispec import LLM, SamplingParams

    options = dict(max_num_seqs=max(s.buckets), max_model_len=s.max_positions, kv_cache_gib=s.kv_cache_gib)
    if not s.graphs:
        options["static_shapes"] = True  # the layout the graphs replay, run eagerly
    if drafter is not None:
        options |= dict(draft_model=drafter, num_speculative_tokens=k)
    llm = LLM(model=(target, tokenizer), **options)
    params = SamplingParams(temperature=0, max_tokens=s.new_tokens, ignore_eos=True)
    llm.generate(prompts(s, 1, 99), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    out = {}
    for b in s.buckets:
        llm.generate(prompts(s, b, b), params, use_tqdm=False)
        m = llm.last_metrics
        steps = max((m.num_steps - m.prefill_steps) / b, 1)  # batch steps (num_steps counts request-steps)
        drafted = (m.num_drafted - m.prefill_drafted) / b
        out[b] = {"tpot_s": m.mean_tpot_s, "step_s": (m.target_s - m.prefill_s) / steps,
                  "tokens_per_step": m.mean_accepted_per_step if drafter is not None else 1.0,
                  "draft_position_s": (m.draft_s - m.draft_prefill_s) / drafted if drafted > 0 else None}
    out["forward_counts"] = dict(llm.engine.target.forward_counts)
    return out


def hf_peer(dims: dict, s: Settings, seed: int) -> dict:
    """transformers' generate on a random-init model of the same config (greedy, batch b, the same
    prompt length): seconds per token after the first, (t(N tokens) - t(1 token)) / (N - 1)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    transformers.logging.set_verbosity_error()
    config = hf_config(dims, s.max_positions)
    config = AutoConfig.for_model(config.pop("model_type"), **{k: v for k, v in config.items() if k != "torch_dtype"})
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(s.dtype)  # built in the measured dtype, on the device
    try:
        with torch.device(s.device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(s.dtype).eval()  # (a no-op where from_config took the default dtype)
    out = {}
    for b in s.buckets:
        ids = torch.tensor(prompts(s, b, b), device=s.device)  # [b, prompt_len]

        def generate(n: int) -> float:
            cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                   temperature=None, top_p=None, top_k=None)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            sync(s.device)
            return time.perf_counter() - start

        generate(2)  # warm-up
        out[b] = {"tpot_s": (generate(s.new_tokens) - generate(1)) / (s.new_tokens - 1)}
    del model
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ sections


def measure_shape(name: str, s: Settings, ceiling: float, seed: int) -> dict:
    """Section 2 for one target shape with its drafters, and section 3's predictions for it."""
    tokenizer = s.tokenizer()
    target = random_transformer(s.shape(name), seed, s.device, s.dtype, s.max_positions)
    result = {"shape": name, "config": s.shape(name), "forwards": forward_costs(target, s, s.buckets, s.q_lens)}
    decode = result["forwards"]["seconds"]
    result["bandwidth"] = {b: {"bytes": read_bytes(target, b, s.context),
                               "share_of_copy": read_bytes(target, b, s.context) / decode[b][1] / ceiling}
                           for b in s.buckets}
    result["plain"] = engine_costs(target, tokenizer, None, 0, s)
    result["drafters"], result["predictions"] = {}, []
    for drafter, kind, k in DRAFTERS[name]:
        if kind == "eagle":
            model = random_eagle_head(target, s.head(name), seed + 1)
        elif kind == "ngram":
            model = "ngram"
        else:
            model = (random_transformer(s.shape(kind), seed + 2, s.device, s.dtype, s.max_positions), tokenizer)
        result["drafters"][drafter] = {"k": k, "engine": engine_costs(target, tokenizer, model, k, s)}
        del model
        free_memory(s.device)
        table = lookup(name, drafter)
        if table is None or table.k + 1 not in s.q_lens:
            continue
        for b in s.buckets:
            t_draft = result["drafters"][drafter]["engine"][b]["draft_position_s"] or 0.0
            result["predictions"].append({
                "shape": name, "drafter": drafter, "batch": b, "k": table.k, "tokens_per_step": table.tokens_per_step,
                "acceptance": acceptance_for(table.tokens_per_step, table.k), "source": table.source,
                "machine": table.machine, "t_decode_s": decode[b][1], "t_verify_s": decode[b][table.k + 1],
                "t_draft_s": t_draft,
                "speedup": predicted_speedup(table.tokens_per_step, table.k, decode[b][1], t_draft, decode[b][table.k + 1])})
    del target
    free_memory(s.device)
    result["transformers"] = hf_peer(s.shape(name), s, seed)
    free_memory(s.device)
    return result


def measure_pair(s: Settings, seed: int) -> dict:
    """Section 4: the controlled pair at each epsilon, predicted against measured."""
    from minispec import LLM, SamplingParams

    tokenizer = s.tokenizer()
    pair = build_pair(s.shape(PAIR_SMALL), s.pair_extra, seed, s.device, s.dtype, s.max_positions)
    costs = forward_costs(pair.target, s, (1,), (1, PAIR_K + 1))["seconds"][1]
    draft_forward = forward_costs(pair.draft, s, (1,), (1,))["seconds"][1][1]
    options = dict(max_num_seqs=1, max_model_len=s.max_positions, kv_cache_gib=s.kv_cache_gib)
    if not s.graphs:
        options["static_shapes"] = True
    plain = LLM(model=(pair.target, tokenizer), **options)
    spec = LLM(model=(pair.target, tokenizer), draft_model=(pair.draft, tokenizer), num_speculative_tokens=PAIR_K, **options)
    params = SamplingParams(temperature=0, max_tokens=s.new_tokens, ignore_eos=True)
    prompt = prompts(s, 1, seed)
    for llm in (plain, spec):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    rows = []
    for epsilon in s.epsilons:
        pair.set_epsilon(epsilon)
        ratios, tokens_per_step, acceptance, draft_s = [], [], [], []
        for _ in range(max(s.repeats // 3, 1)):  # (the GPU's 10 timed forwards: 3 pairs of runs)
            plain.generate(prompt, params)
            plain_tpot = plain.last_metrics.mean_tpot_s
            spec.generate(prompt, params)
            m = spec.last_metrics
            ratios.append(plain_tpot / m.mean_tpot_s)
            tokens_per_step.append(m.mean_accepted_per_step)
            acceptance.append(m.acceptance_rate)
            drafted = m.num_drafted - m.prefill_drafted
            draft_s.append((m.draft_s - m.draft_prefill_s) / drafted if drafted else 0.0)
        E, t_draft = statistics.median(tokens_per_step), statistics.median(draft_s)
        predicted = predicted_speedup(E, PAIR_K, costs[1], t_draft, costs[PAIR_K + 1])
        measured = statistics.median(ratios)
        rows.append({"epsilon": epsilon, "acceptance": statistics.median(acceptance), "tokens_per_step": E,
                     "t_draft_s": t_draft, "predicted": predicted, "measured": measured,
                     "measured_over_predicted": measured / predicted, "ratios": ratios})
    return {"small": PAIR_SMALL, "extra_layers": s.pair_extra, "k": PAIR_K, "t_decode_s": costs[1],
            "t_verify_s": costs[PAIR_K + 1], "draft_forward_s": draft_forward, "rows": rows}


# ------------------------------------------------------------------------------------ report


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def markdown(result: dict) -> str:
    """The tables for docs/results.md and the README."""
    lines = [f"# GPU measurement: {result['device']}, {result['dtype']}, {result['when']}", ""]
    if "copy_bytes_per_s" in result:
        lines += [f"Copy ceiling {result['copy_bytes_per_s'] / 1e12:.2f} TB/s (device-to-device copy, read + written).", ""]
    shapes = result.get("shapes", [])
    if shapes:
        lines += ["| shape | batch | decode ms | verify ms, k+1 = " + ", ".join(str(q) for q in result["q_lens"][1:])
                  + " | decode GB/s | of copy | minispec TPOT ms | transformers TPOT ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in shapes:
            for b in result["buckets"]:
                sec = r["forwards"]["seconds"][b]
                bw = r["bandwidth"][b]
                hf = r["transformers"][b]["tpot_s"]
                lines.append(f"| {r['shape']} | {b} | {ms(sec[1])} | {', '.join(ms(sec[q]) for q in result['q_lens'][1:])} "
                             f"| {bw['bytes'] / sec[1] / 1e9:.0f} | {bw['share_of_copy']:.0%} | {ms(r['plain'][b]['tpot_s'])} "
                             f"| {ms(hf)} |")
        lines += ["", "| shape | drafter | k | tok/step (CPU, real weights) | batch | drafted position ms | "
                  "verify ms | predicted speedup |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in shapes:
            for p in r["predictions"]:
                lines.append(f"| {p['shape']} | {p['drafter']} | {p['k']} | {p['tokens_per_step']:.2f} (a = "
                             f"{p['acceptance']:.2f}) | {p['batch']} | {ms(p['t_draft_s'])} | {ms(p['t_verify_s'])} "
                             f"| {p['speedup']:.2f}x |")
        lines += ["", "Acceptance sources: " + "; ".join(sorted({f"{p['shape']} {p['drafter']}: {p['source']} "
                                                                  f"({p['machine']})" for r in shapes
                                                                  for p in r["predictions"]})), ""]
    pair = result.get("pair")
    if pair:
        lines += [f"Controlled pair: {pair['small']} draft, target = its layers + {pair['extra_layers']} scaled by "
                  f"epsilon, k = {pair['k']}, batch 1; decode {ms(pair['t_decode_s'])} ms, verify "
                  f"{ms(pair['t_verify_s'])} ms, draft forward {ms(pair['draft_forward_s'])} ms.", "",
                  "| epsilon | acceptance | tok/step | drafted position ms | predicted | measured | measured / predicted |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in pair["rows"]:
            lines.append(f"| {row['epsilon']:g} | {row['acceptance']:.2f} | {row['tokens_per_step']:.2f} | "
                         f"{ms(row['t_draft_s'])} | {row['predicted']:.2f}x | {row['measured']:.2f}x | "
                         f"{row['measured_over_predicted']:.2f} |")
    if result.get("skipped"):
        lines += ["", "Skipped (time budget): " + ", ".join(result["skipped"])]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_measure.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "gpu_measure.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="every section at a CPU's size (the dry run)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no section after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("gpu_measure: no CUDA device; --tiny runs every section at a CPU's size")
    s = settings(args.tiny, device)
    if s.tiny:
        torch.set_num_threads(1)  # tiny matmuls: a second thread only waits for a busy core
    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(device) if s.graphs else "cpu", "dtype": str(s.dtype).removeprefix("torch."),
              "when": time.strftime("%Y-%m-%d"), "tiny": s.tiny, "settings": {k: v for k, v in asdict(s).items()
                                                                              if k not in ("device", "dtype")},
              "buckets": list(s.buckets), "q_lens": list(s.q_lens), "context": s.context, "shapes": [], "skipped": []}
    result["copy_bytes_per_s"] = measure_ceilings(device)["copy_bytes_per_s"]
    write(result, args.out)
    def shape_section(name: str):
        return name, lambda: result["shapes"].append(measure_shape(name, s, result["copy_bytes_per_s"], args.seed))

    # Most valuable first. SmolLM2's section takes the same paths as the others (a draft model, a
    # head, n-gram): --tiny leaves it out to keep the dry run short.
    sections = [shape_section("qwen2.5-1.5b"), shape_section("llama-3.1-8b"),
                ("controlled pair", lambda: result.update(pair=measure_pair(s, args.seed)))]
    sections += [] if s.tiny else [shape_section("smollm2-135m")]
    for name, run in sections:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            result["skipped"].append(name)
            print(f"gpu_measure: {name} skipped ({elapsed:.0f} s of the {args.budget_s:.0f} s budget gone)", flush=True)
            continue
        run()
        print(f"gpu_measure: {name} done at {time.perf_counter() - start:.0f} s", flush=True)
        write(result, args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
