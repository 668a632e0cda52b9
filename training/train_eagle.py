"""Train minispec's EAGLE-3 head for its default target (SmolLM2-135M-Instruct).

Pipeline (progress lines throughout; every size is a flag; defaults = a CPU run, the GPU
command below = the run in the model card):

1. corpus    the target's answers to the training prompts (training/corpus.py; the rows
             training/distill.py uses, read from the same cache, generated where missing;
             --generator hf: transformers' batched generate writes prompts and answers, a GPU's
             fast path).
2. features  one teacher-forced forward of the target (fp32) per sequence, keeping at every
             position the draft's input features (the residual stream entering target layers
             2, L//2, L-3), the last layer's output (the target's logits over the draft
             vocabulary are computed from it while training) and the target's argmax.
3. vocab     the draft vocabulary: the V_d most frequent tokens of the training responses (EOS
             included), sorted by id (d2t / t2d). Several sizes are compared (--draft-vocab), each
             trained on a share of the data and judged by `chain_estimate` on the validation
             answers: greedy decoding's rounds replayed teacher-forced (2.057 where minispec's
             engine measured 2.070 on the same 16 answers, both when a request's first step still
             drafted), so the choice never looks at the bench.
4. train     the EAGLE-3 training-time test: S unrolled steps (S = 7). Step 0 at index t reads
             (fc(target features at t), token t+1); step i reads (its own step i-1 output at t,
             token t+i+1), RoPE position t+i, and attends to step 0's keys at indices <= t plus
             steps 1..i's keys at index t (what a chained draft step sees at inference). Tokens
             stay teacher-forced. Loss: soft cross-entropy against the target's softmax over the
             draft vocabulary at position t+i+1, on response positions where the target's argmax
             is in the draft vocabulary, weighted 0.8^i. AdamW (0.9, 0.95), warmup + cosine, clip.
             The lm_head starts from the target's head rows, the final norm from the target's.
5. eval      greedy speculative decoding (k = 4) with minispec on held-out bench prompts: tokens per
             target step and per-position acceptance, next to the distilled draft and n-gram
             (--skip-eval on a GPU box, then --card-only on the CPU that benches it).
6. save      bf16 safetensors in the official EAGLE-3 layout, training.json and a model card.

Run: python training/train_eagle.py --threads 2     (CPU: sizes 4096 and 8192 compared on 25% of the
                                                    data, 25/50% growth points, the chosen size on all)
     ... --cached-only                              (train on the corpus rows already cached)
     python training/train_eagle.py --device cuda --threads 8 --generator hf \
         --cache-dir weights/cache/eagle-gpu/corpus --self-prompts-file weights/cache/eagle-gpu/self.jsonl \
         --num-self-prompts 12288 --gen-batch-size 1024 --max-tokens 256 --generate-budget-s 120 \
         --batch-tokens 16384 --feature-chunk-tokens 8192 --epochs 10 --train-budget-s 100 --max-len 512 \
         --draft-vocab 4096,8192 --vocab-share 0.25 --fractions 0.25,0.5 --skip-eval
                                                    (one H200, about 7 minutes), then the same command with
                                                    --num-self-prompts 16384 --deadline-s 537 (4,096 more
                                                    self-prompts, appended; the deadline skips what does not fit):
                                                    the cached answers are kept, 120 s more are written, and
                                                    everything is trained again (about 8 minutes): the shipped head
     python training/train_eagle.py --card-only --cache-dir weights/cache/eagle-gpu/corpus   (then, on CPU)
     python training/train_eagle.py --num-generate 8 --max-tokens 16 --epochs 1 --out /tmp/e   (smoke)
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
from corpus import REPO_ROOT, default_target, eval_prompts, evaluate_drafts, generate_corpus, load_prompts, log  # noqa: E402
from make_prompts import read_jsonl  # noqa: E402

from minispec import BatchMetadata, load_checkpoint  # noqa: E402
from minispec.io.eagle_checkpoint import load_eagle, save_eagle  # noqa: E402
from minispec.model.eagle import EagleModel, default_aux_layers, init_eagle  # noqa: E402
from minispec.model.llama import Transformer, apply_rope, rope_tables  # noqa: E402

# --- 2. features --------------------------------------------------------------------------------


@torch.inference_mode()
def extract_features(target: Transformer, rows: list[dict], aux_layers: tuple[int, ...], max_len: int,
                     chunk_tokens: int = 2048) -> list[dict]:
    """Per corpus row with a response (cut to max_len tokens): its row index, whether it was answered
    greedily, ids [T], prompt length, features [T, 3H] bf16, last-layer output [T, H] bf16 and the
    target's argmax [T] (on the target's device); sequences packed into cache-free forwards of
    about chunk_tokens tokens."""
    L = target.cfg.num_layers
    out, batch = [], []
    t0, done = time.perf_counter(), 0

    def flush():
        nonlocal done
        lengths = [len(ids) for ids, _, _ in batch]
        ids = torch.tensor([t for seq, _, _ in batch for t in seq], device=target.device)
        logits, hidden = target(ids, BatchMetadata.for_prompts(lengths, target.device), None, hidden_layers=(*aux_layers, L))
        H = target.cfg.hidden_size
        start = 0
        for (seq, prompt_len, row), n in zip(batch, lengths):
            h = hidden[start : start + n]
            out.append({"row": row, "greedy": rows[row]["temperature"] == 0, "ids": torch.tensor(seq),
                        "prompt_len": prompt_len, "features": h[:, : 3 * H].bfloat16(),
                        "last": h[:, 3 * H :].bfloat16(), "argmax": logits[start : start + n].argmax(-1)})
            start += n
        done += sum(lengths)
        batch.clear()

    for row, r in enumerate(rows):
        seq = (r["prompt_ids"] + r["output_ids"])[:max_len]
        if len(seq) <= len(r["prompt_ids"]):
            continue
        batch.append((seq, len(r["prompt_ids"]), row))
        if sum(len(s) for s, _, _ in batch) >= chunk_tokens:
            flush()
            if len(out) % 64 < len(batch) + 8:
                log(f"features: {len(out)}/{len(rows)} sequences, {done} tokens ({done / (time.perf_counter() - t0):.0f} tok/s)")
    if batch:
        flush()
    log(f"features: {len(out)} sequences, {done} tokens in {time.perf_counter() - t0:.0f}s")
    return out


# --- 3. vocabulary -------------------------------------------------------------------------------


def draft_vocabulary(examples: list[dict], size: int, vocab_size: int, eos_ids: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens (ties by id), EOS ids always in; sorted ids [size]."""
    counts = Counter()
    for e in examples:
        counts.update(e["ids"][e["prompt_len"] :].tolist())
    chosen = [t for t in eos_ids if t < vocab_size]
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    rest = (t for t in range(vocab_size) if t not in set(chosen))  # a corpus with fewer distinct tokens
    while len(chosen) < size:
        chosen.append(next(rest))
    return torch.tensor(sorted(chosen))


def coverage(examples: list[dict], ids: torch.Tensor) -> float:
    """Share of response tokens inside the draft vocabulary."""
    inside = torch.zeros(int(max(ids.max().item(), max(e["ids"].max().item() for e in examples))) + 1, dtype=torch.bool)
    inside[ids] = True
    hits = total = 0
    for e in examples:
        resp = e["ids"][e["prompt_len"] :]
        hits += inside[resp].sum().item()
        total += resp.numel()
    return hits / max(total, 1)


# --- 4. the training-time test --------------------------------------------------------------------


def shifted(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, T, ...] moved n places left along T, zero-padded at the end."""
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def unrolled_logits(model: EagleModel, ids: torch.Tensor, feats: torch.Tensor, steps: int):
    """The training-time test's forward, one step at a time: yields logits [B, T, V_d] of step i
    = 0..steps-1. ids [B, T] (right-padded), feats [B, T, 3H] target features. Step i at index t:
    token ids[t+i+1], feature fc(feats[t]) (i = 0) or step i-1's output g at t, RoPE position
    t+i; it attends to step 0's keys at indices <= t and steps 1..i's keys at index t, which is
    what the chained draft step at position t+i sees at inference (tests/test_eagle.py checks it)."""
    cfg = model.config.layer
    B, T = ids.shape
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    scale = D**-0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()  # [T, T] query t sees step-0 key j <= t
    layer = model.midlayer
    attn = layer.self_attn
    keys, values = [], []
    feature = model.fc(feats)  # [B, T, H]
    for i in range(steps):
        emb = F.embedding(shifted(ids, i + 1), model.embed_weight)  # token t+i+1
        normed = layer.hidden_norm(feature)
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)  # [B, T, 2H]
        cos, sin = rope_tables(torch.arange(T, device=ids.device) + i, model.inv_freq, x.dtype)  # [T, 1, D]
        q, k, v = attn.project(x).split(attn.qkv_sizes, dim=-1)
        q = apply_rope(q.reshape(B, T, Hq, D), cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = apply_rope(k.reshape(B, T, Hkv, D), cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.reshape(B, T, Hkv, D).transpose(1, 2)
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, T, D]
        keys.append(k)
        values.append(v)
        scores = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, Hq, T, T]
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # i x [B, Hq, T, 1]
        weights = torch.cat([scores, *diag], dim=-1).softmax(-1)  # [B, Hq, T, T + i]
        out = weights[..., :T] @ values[0]  # [B, Hq, T, D]
        for j, vj in enumerate(values[1:]):
            out = out + weights[..., T + j : T + j + 1] * vj
        residual = normed if model.config.norm_before_residual else feature
        r = residual + attn.o_proj(out.transpose(1, 2).reshape(B, T, Hq * D))
        g = r + layer.mlp(layer.post_attention_layernorm(r))  # [B, T, H]
        logits = model.lm_head(model.norm(g))  # [B, T, V_d]
        yield logits
        feature = g


def padded(model: EagleModel, batch: list[dict]):
    """A batch of examples right-padded on the model's device: ids [B, T], features [B, T, 3H],
    last-layer outputs [B, T, H], target argmax [B, T] (-1 in padding), valid [B, T] and response
    [B, T] (position t's next token is a response token)."""
    B, T, H = len(batch), max(e["ids"].numel() for e in batch), model.config.layer.hidden_size
    dev = model.device
    ids = torch.zeros(B, T, dtype=torch.int64, device=dev)
    feats = torch.zeros(B, T, model.fc.in_features, device=dev)
    last = torch.zeros(B, T, H, device=dev)
    argmax = torch.full((B, T), -1, dtype=torch.int64, device=dev)
    valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
    response = torch.zeros(B, T, dtype=torch.bool, device=dev)
    for b, e in enumerate(batch):
        n = e["ids"].numel()
        ids[b, :n], feats[b, :n], last[b, :n], argmax[b, :n] = e["ids"], e["features"].float(), e["last"].float(), e["argmax"]
        valid[b, :n] = True
        response[b, max(e["prompt_len"] - 1, 0) : n] = True
    return ids, feats, last, argmax, valid, response


def ttt_loss(model: EagleModel, target: Transformer, batch: list[dict], steps: int, decay: float = 0.8):
    """The unrolled training-time test on a batch of examples. Returns (loss, per-step top-1
    agreement and weights [steps], per-step loss [steps])."""
    ids, feats, last, argmax, valid, response = padded(model, batch)
    draft_ids = model.draft_to_target(torch.arange(model.config.draft_vocab_size, device=model.device))
    with torch.no_grad():
        target_logits = F.linear(target.norm(last), target.lm_head.weight[draft_ids])  # [B, T, V_d]
        target_probs = target_logits.softmax(-1)
        in_vocab = model.t2d[argmax.clamp(min=0)] & (argmax >= 0)  # [B, T]
        target_best = target_logits.argmax(-1)
    total = torch.zeros((), device=model.device)
    stats, losses = [], []
    for i, logits in enumerate(unrolled_logits(model, ids, feats, steps)):
        p, best = shifted(target_probs, i + 1), shifted(target_best, i + 1)  # at position t+i+1
        mask = shifted(valid & response & in_vocab, i + 1)  # [B, T]
        if mask.any():
            ce = -(p * logits.log_softmax(-1)).sum(-1)  # [B, T]
            loss = ce[mask].mean()
            total = total + decay**i * loss
            stats.append(((logits.argmax(-1) == best)[mask].float().mean().item(), mask.sum().item()))
            losses.append(loss.item())
        else:
            stats.append((0.0, 0))
            losses.append(0.0)
    return total, stats, losses


def batches(examples: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Length-sorted groups of about batch_tokens padded tokens, in a shuffled order."""
    order = sorted(range(len(examples)), key=lambda i: examples[i]["ids"].numel())
    groups, cur = [], []
    for i in order:
        cur.append(examples[i])
        if len(cur) * examples[i]["ids"].numel() >= batch_tokens:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def evaluate_ttt(model: EagleModel, target: Transformer, examples: list[dict], steps: int, batch_tokens: int = 4096) -> list[float]:
    """Per-step top-1 agreement with the target over examples (teacher-forced tokens, own features)."""
    hits, count = [0.0] * steps, [0] * steps
    with torch.no_grad():
        for group in batches(examples, batch_tokens, random.Random(0)):
            _, stats, _ = ttt_loss(model, target, group, steps)
            for i, (acc, n) in enumerate(stats):
                hits[i] += acc * n
                count[i] += n
    return [h / max(c, 1) for h, c in zip(hits, count)]


def record_run(runs_file: Path, argv: list[str]) -> list[str]:
    """Add argv to runs_file (every training run over one corpus cache, oldest first; a rerun of
    the same command moves to the end instead of appearing twice). Returns the other runs."""
    earlier = [run for run in (json.loads(runs_file.read_text()) if runs_file.exists() else []) if run != argv]
    runs_file.write_text(json.dumps(earlier + [argv]) + "\n")
    return earlier


@torch.no_grad()
def chain_estimate(model: EagleModel, examples: list[dict], k: int, batch_tokens: int = 4096) -> tuple[float, list[float]]:
    """Greedy tokens per target step at k (bonus included), replayed teacher-forced on answers the
    target wrote greedily (so token t+1 is the target's argmax at t, as in greedy decoding), each
    decoded to its end with max_tokens = its length, the way minispec's engine runs it:
    - a round at index t has target features up to t and token t+1 in hand; chained step i
      proposes token t+i+2, accepted while it equals the target's argmax at t+i+1; n(t) = the
      leading accepted count, never proposing the answer's last token (it is the free final one);
    - the first round is the prompt's prefill: it emits the first answer token and drafts
      nothing (the engine drafts from a request's second step on); the next round is at P-1; a
      round emits n(t) + 1 tokens and the next is at t + 1 + n(t); rounds run while a token is
      left to emit.
    Returns (1 + accepted / rounds over all rows, per-position acceptance P(n > i | n >= i))."""
    accepted = rounds = 0
    reach = [0] * (k + 1)  # reach[i]: rounds with n >= i
    for group in batches([e for e in examples if e.get("greedy")], batch_tokens, random.Random(0)):
        ids, feats, _, argmax, valid, _ = padded(model, group)
        alive = valid.clone()
        n = torch.zeros_like(ids)  # [B, T]
        for i, logits in enumerate(unrolled_logits(model, ids, feats, k)):
            proposed = model.draft_to_target(logits.argmax(-1))  # [B, T] target ids
            alive &= (proposed == shifted(argmax, i + 1)) & shifted(valid, i + 3)  # token t+i+2 not the last
            n += alive
        n = n.cpu()
        for b, e in enumerate(group):
            t, end = e["prompt_len"] - 1, e["ids"].numel()
            rounds += end > e["prompt_len"]  # the prefill: one token, no drafts (no reach)
            while t + 2 < end:  # token t+2 is still to emit
                a = int(n[b, t])
                accepted, rounds = accepted + a, rounds + 1
                for i in range(a + 1):
                    reach[i] += 1
                t += 1 + a
    if rounds == 0:
        return float("nan"), [float("nan")] * k
    return 1 + accepted / rounds, [reach[i + 1] / reach[i] if reach[i] else 0.0 for i in range(k)]


def train(target: Transformer, train_ex: list[dict], val_ex: list[dict], draft_ids: torch.Tensor, args,
          budget_s: float = 0.0) -> tuple[EagleModel, dict]:
    """Initialise a head with this draft vocabulary and train it for args.epochs; returns (model,
    stats). budget_s > 0: the step count is cut, before the learning-rate schedule is fixed, to
    what fits in budget_s at the speed of the first steps (timed on a copy that is thrown away)."""
    model = init_eagle(target, draft_ids, intermediate_size=args.ffn, seed=args.seed,
                       norm_before_residual=args.norm_before_residual)
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        model.norm.weight.copy_(target.norm.weight)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    rng = random.Random(args.seed + 1)
    plan = [batches(train_ex, args.batch_tokens, rng) for _ in range(args.epochs)]
    total_steps = sum(len(p) for p in plan)
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    if budget_s > 0:
        per_step = time_steps(model, target, plan[0], args)
        fits = max(1, int(budget_s / per_step))
        log(f"train V_d={len(draft_ids)}: {per_step * 1000:.0f} ms per step; {min(fits, total_steps)} of {total_steps} steps "
            f"fit in {budget_s:.0f}s")
        total_steps = min(total_steps, fits)
    warmup = max(1, int(args.warmup * total_steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the bench extra; plain progress lines without it
        tqdm = None
    bar = tqdm(total=total_steps, desc=f"train V_d={len(draft_ids)}", file=sys.stderr, mininterval=5) if tqdm else None
    curve, window, step, t0 = [], [], 0, time.perf_counter()
    val_curve = []
    for epoch, groups in enumerate(plan):
        if step >= total_steps:
            break
        for group in groups:
            if step >= total_steps:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, stats = optimizer_step(model, target, opt, group, args)
            window.append((loss.item(), stats[0][0], stats[-1][0]))
            step += 1
            if bar:
                bar.update(1)
            if step % args.log_every == 0 or step == total_steps:
                n = len(window)
                mean = [sum(w[j] for w in window) / n for j in range(3)]
                curve.append({"step": step, "loss": mean[0], "top1_step0": mean[1], f"top1_step{args.steps - 1}": mean[2]})
                log(f"train V_d={len(draft_ids)}: step {step}/{total_steps} loss {mean[0]:.3f} top-1 step 0 {mean[1]:.3f}, "
                    f"step {args.steps - 1} {mean[2]:.3f} ({time.perf_counter() - t0:.0f}s)")
                window = []
        if val_ex:
            model.eval()
            val_curve.append(evaluate_ttt(model, target, val_ex, args.steps, args.batch_tokens))
            model.train()
            log(f"train V_d={len(draft_ids)}: epoch {epoch + 1} validation top-1 per step {[round(x, 3) for x in val_curve[-1]]}")
    if bar:
        bar.close()
    model.eval()
    return model, {"curve": curve, "val": val_curve, "steps": total_steps, "seconds": time.perf_counter() - t0}


def optimizer_step(model: EagleModel, target: Transformer, opt: torch.optim.Optimizer, group: list[dict], args):
    """One step of the training-time test on a batch (gradients clipped); returns (loss, per-step stats)."""
    loss, stats, _ = ttt_loss(model, target, group, args.steps)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], args.clip)
    opt.step()
    return loss, stats


def time_steps(model: EagleModel, target: Transformer, groups: list[list[dict]], args, n: int = 6) -> float:
    """Seconds per training step on a copy of model (the first of n steps is not counted)."""
    clone = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in clone.parameters() if p.requires_grad], lr=args.lr)
    groups = groups[:n]
    skip = 1 if len(groups) > 1 else 0  # the first step (allocations, autotuning) is not counted
    t0 = time.perf_counter()
    for j, group in enumerate(groups):
        if j == skip:
            synchronize(model.device)
            t0 = time.perf_counter()
        optimizer_step(clone, target, opt, group, args)
    synchronize(model.device)
    return (time.perf_counter() - t0) / (len(groups) - skip)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 5. evaluation and 6. the card ---------------------------------------------------------------


def write_card(out: Path, info: dict) -> None:
    ev = info["eval"]
    k = info["k"]
    table = "\n".join(
        f"| {name} | {m['mean_accepted_per_step']:.2f} | {m['acceptance_rate']:.3f} | "
        f"{', '.join(f'{x:.2f}' for x in m['per_position_acceptance'])} |"
        for name, m in ev.get("drafts", {}).items()) or "| (not evaluated yet: `--card-only`) | | | |"
    sizes = "\n".join(
        f"| {r['draft_vocab']} | {r['coverage']:.3f} | {r['macs'] / 1e6:.1f}M | {', '.join(f'{x:.3f}' for x in r.get('val_top1', []))} | "
        f"{r.get('accepted_per_step', float('nan')):.2f} |" for r in info["vocab_runs"])
    growth = "\n".join(
        f"| {r['fraction']:.0%} | {r['tokens']:,} | {', '.join(f'{x:.3f}' for x in r['val_top1'])} | {r['accepted_per_step']:.2f} |"
        for r in info["growth"])
    points = info["train"]["curve"]
    every = max(1, math.ceil(len(points) / 24))  # at most ~24 rows, the last one always
    curve = "\n".join(f"| {c['step']} | {c['loss']:.3f} | {c['top1_step0']:.3f} |"
                      for i, c in enumerate(points) if i % every == every - 1 or i == len(points) - 1)
    sp = info["self_prompts"]
    est = "est. tokens per target step"
    how = ("estimated by replaying greedy decoding's rounds teacher-forced on the greedy validation answers "
           "(`chain_estimate`: a round accepts the leading chained proposals equal to the target's argmax, "
           "plus one token, the prompt's prefill a round of one; on 16 validation answers it gave 2.057 where "
           "minispec's engine measured 2.070, both when a request's first step still drafted)")
    replay = info.get("val_replay")
    replay_line = (f"Replaying greedy decoding's rounds on the {replay['answers']} greedy validation answers (whole "
                   f"answers, the shipped bf16 weights, `--card-only`): **{replay['accepted_per_step']:.2f}** tokens per "
                   f"target step, per-position acceptance {', '.join(f'{x:.2f}' for x in replay['per_position'])} "
                   f"(P(n > i | n >= i)).\n" if replay else "")
    if info["generator"] == "hf":
        data = (f"{info['num_rows']} target answers written for this head (`training/corpus.py --generator hf`: "
                f"`transformers`' batched generate on {info['device_name']}, fp32): {info['answers_per_prompt']} answer{'s' if info['answers_per_prompt'] > 1 else ''} per "
                f"prompt (the first greedy for a share {info['greedy_fraction']:g} of the prompts, the rest sampled at "
                f"temperature {info['temperature']:g}, plain sampling), at most {info['max_tokens']} tokens, to "
                f"`weights/prompts/train.jsonl` and {sp['kept']} user messages the target wrote itself from its bare chat "
                f"template (Magpie: {sp['asked']} asked at temperature {info['self_prompt_temperature']:g}, kept when "
                f"closed by EOS, new, and sharing no 5-word run with a bench prompt)")
    else:
        data = (f"{info['num_rows']} target answers from the shared corpus (`training/corpus.py`: the same cached rows "
                f"`training/distill.py` trains on; greedy and temperature-0.8 answers to `weights/prompts/train.jsonl` "
                f"and self-written prompts, none sharing a subject with the bench prompts)")
    # the earlier runs over the same corpus cache (its runs.json: the corpus they wrote is part of
    # this run's), this run, then the CPU step that evaluated it with this run's paths
    commands = "\n".join(f"python training/train_eagle.py {' '.join(a)}" for a in [*info.get("earlier_runs", []), info["argv"]])
    if replay or ev:
        argv = info["argv"]
        paths = [f"{flag} {argv[argv.index(flag) + 1]}" for flag in ("--target", "--out", "--cache-dir") if flag in argv]
        commands += "\n" + " ".join(["python training/train_eagle.py --card-only", *paths]) + "   # on the CPU"
    text = f"""---
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
tags: [speculative-decoding, eagle-3, minispec]
---

# eagle-smollm2: an EAGLE-3 head for SmolLM2-135M-Instruct

A one-layer feature drafter (EAGLE-3, Li et al. 2025) for minispec's default target. It reads the
target's hidden states (the inputs of target layers {list(info['aux_layers'])}), shares the target's
embedding (not stored here) and proposes from a draft vocabulary of {info['draft_vocab']} tokens
(d2t / t2d map it to the target's 49152). Official EAGLE-3 checkpoint layout (`fc`,
`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`); bf16, {info['bytes'] / 2**20:.1f} MB.
Use: `LLM(model=target, draft_model=minispec.io.paths.default_eagle_head())` (it installs with minispec) or `python bench.py --drafters eagle`.
`training.json` beside this card holds every number below.

## Data

{data}; cut to {info['max_len']} tokens: {info['train_tokens']:,} training tokens
({info['train_response_tokens']:,} in responses); {len(info['val_keys'])} answers held out for validation.
Features: one fp32 teacher-forced target forward per sequence ({info['feature_s']:.0f}s).

## Training

Training-time test with {info['steps']} unrolled steps (teacher-forced tokens, the head's own
features after step 0), soft cross-entropy against the target's softmax over the draft
vocabulary, step weights 0.8^i; AdamW lr {info['lr']} (betas 0.9/0.95), warmup + cosine, clip
{info['clip']}, about {info['batch_tokens']} tokens a batch, {info['train']['steps']} steps
(at most {info['epochs']} epochs), {'fp32 with TF32 matmuls' if info.get('tf32') else 'fp32'} on {info['device_name']} ({info['train']['seconds'] / 60:.1f} min).
The lm_head starts from the target's head rows of the draft vocabulary, the final norm from the target's.

Loss curve (each row: the mean over the logging window ending at that step):

| step | loss | top-1 at step 0 |
| --- | --- | --- |
{curve}

## Draft vocabulary size

Each size trained the same way on {info['vocab_share']:.0%} of the training answers. Columns: response
tokens the vocabulary covers; multiply-adds of one chained draft step (the head is the part that
grows); validation top-1 agreement with the target per unrolled step (teacher-forced tokens);
greedy tokens per target step at k = {k}, {how}:

| V_d | tokens covered | MACs per draft step | validation top-1 per step | {est} |
| --- | --- | --- | --- | --- |
{sizes}

Shipped: V_d = {info['draft_vocab']} ({info['why']}).

## How acceptance grows with data

The shipped vocabulary trained on a share of the training answers (the same settings; the step
count follows the share):

| share | training tokens | validation top-1 per step | {est} |
| --- | --- | --- | --- |
{growth}

{replay_line}
## Held-out acceptance

Greedy speculative decoding with minispec, k = {k}, {ev.get('prompts', 0)} bench prompts
(subjects never trained on), {ev.get('tokens', 0)} tokens each; tokens per target step include
the bonus token:

| drafter | tokens per target step | acceptance | per position, P(n > i) |
| --- | --- | --- | --- |
{table}

## Command

```
{commands}
```
"""
    (out / "README.md").write_text(text)


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description="Train the EAGLE-3 head for the default target.")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "weights" / "eagle-smollm2")
    corpus.add_arguments(ap)
    g = ap.add_argument_group("head and training")
    g.add_argument("--draft-vocab", default="4096,8192", help="comma list of draft vocabulary sizes to compare")
    g.add_argument("--ffn", type=int, default=None, help="the layer's MLP width (default: the target's)")
    g.add_argument("--steps", type=int, default=7, help="unrolled steps of the training-time test")
    g.add_argument("--norm-before-residual", action=argparse.BooleanOptionalAction, default=True,
                   help="the layer's residual starts from hidden_norm(feature), not the raw feature (SmolLM2's "
                        "residual stream has dimensions averaging 100-360 and outliers near 25,000 in layers 15 and "
                        "27: a raw residual drowns the layer's output)")
    g.add_argument("--epochs", type=int, default=2)
    g.add_argument("--batch-tokens", type=int, default=768)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=float, default=0.05)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip", type=float, default=0.5)
    g.add_argument("--max-len", type=int, default=384, help="cut training sequences to this many tokens")
    g.add_argument("--val-fraction", type=float, default=0.05)
    g.add_argument("--max-rows", type=int, default=0, help="use only the first N corpus rows (0: all)")
    g.add_argument("--cached-only", action="store_true", help="train on the corpus rows already cached, generate none")
    g.add_argument("--vocab-share", type=float, default=0.25, help="share of the training data each vocabulary size is compared on")
    g.add_argument("--fractions", default="0.25,0.5", help="comma list of training shares for the data-growth table (e.g. 0.25,0.5)")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--max-steps", type=int, default=0, help="at most this many optimizer steps per run (0: the epochs')")
    g.add_argument("--train-budget-s", type=float, default=0.0,
                   help="seconds of optimizer steps for the full-data run (a share-f run gets f times it; validation "
                        "passes come on top); the step count is cut to fit, timed on the first steps (0: no limit)")
    g.add_argument("--deadline-s", type=float, default=0.0,
                   help="whole-run limit in seconds: the extra data-growth runs are skipped when they would pass it (0: none)")
    g.add_argument("--feature-chunk-tokens", type=int, default=2048, help="tokens per teacher-forced feature forward")
    g = ap.add_argument_group("evaluation")
    g.add_argument("--eval-per-category", type=int, default=2)
    g.add_argument("--eval-tokens", type=int, default=64)
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument("--draft", type=Path, default=REPO_ROOT / "weights" / "draft-smollm2",
                   help="the token-only draft model compared with the head")
    g.add_argument("--skip-eval", action="store_true",
                   help="no held-out evaluation (e.g. on a GPU box); run --card-only later to add it and rewrite the card")
    g.add_argument("--card-only", action="store_true",
                   help="evaluate the head in --out (its training.json) on the held-out prompts and rewrite its card")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    default_target(args)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.card_only:
        return card_only(args, argv)
    start = time.perf_counter()

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - start) if args.deadline_s else float("inf")

    # 1. corpus (generated in the dtype --target-dtype names; features in fp32)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    gen_target = load_checkpoint(args.target, dtype=getattr(torch, args.target_dtype), device=args.device, backend="torch")
    prompts, _, bench, self_info = load_prompts(args, gen_target)
    rows = generate_corpus(gen_target, prompts, args, args.cache_dir, generate=not args.cached_only)
    earlier_runs = record_run(args.cache_dir / "runs.json", argv)
    if args.max_rows:
        rows = rows[: args.max_rows]
    del gen_target
    target, tokenizer = load_checkpoint(args.target, dtype=torch.float32, device=args.device, backend="torch")
    aux = default_aux_layers(target.cfg.num_layers)

    # 2. features (cached on disk when on the CPU; a GPU recomputes them in seconds)
    rng = random.Random(args.seed + 1)
    prompt_ids = sorted({r["id"] for r in rows})  # a prompt's answers (--answers-per-prompt) stay on one side
    val_prompts = set(rng.sample(prompt_ids, max(1, int(args.val_fraction * len(prompt_ids)))))
    val_idx = {i for i, r in enumerate(rows) if r["id"] in val_prompts}
    t0 = time.perf_counter()
    key = hashlib.sha256(json.dumps(["v2", str(args.target), aux, args.max_len, [r["key"] for r in rows]]).encode()).hexdigest()[:16]
    cached = args.cache_dir.parent / "eagle" / f"features-{key}.pt"
    if cached.exists() and target.device.type == "cpu":
        examples, feature_s = torch.load(cached)
        log(f"features: {len(examples)} sequences read from {cached}")
    else:
        examples = extract_features(target, rows, aux, args.max_len, args.feature_chunk_tokens)
        feature_s = time.perf_counter() - t0
        if target.device.type == "cpu":
            cached.parent.mkdir(parents=True, exist_ok=True)
            torch.save((examples, feature_s), cached)
    train_ex = [e for e in examples if e["row"] not in val_idx]
    val_ex = [e for e in examples if e["row"] in val_idx]
    if target.device.type == "cuda":  # training matmuls in TF32 (the features above were fp32)
        torch.backends.cuda.matmul.allow_tf32 = True
    log(f"data: {len(train_ex)} training / {len(val_ex)} validation sequences "
        f"({sum(e.get('greedy', False) for e in val_ex)} validation answers greedy)")

    # 3 + 4. the draft vocabulary: each size trained the same way on a share of the data; the size
    # with the most (estimated) validation tokens per target step is trained on all of it and shipped.
    random.Random(args.seed + 2).shuffle(train_ex)  # shares below are random subsets
    eos = target.cfg.eos_token_ids or tokenizer.eos_token_ids
    vocab_dir = args.cache_dir.parent / "eagle"
    k = args.num_speculative_tokens

    def share_of(frac: float) -> list[dict]:
        return train_ex[: max(1, int(frac * len(train_ex)))]

    def trained(examples: list[dict], ids: torch.Tensor, name: str, frac: float) -> tuple[EagleModel, dict]:
        """Train (or reuse the cached result of the same run: a later invocation adds comparisons
        without retraining what an earlier one trained) and estimate validation acceptance."""
        settings = ["replay-v2", key, name, args.epochs, args.lr, args.batch_tokens, args.steps, args.seed, args.ffn, args.clip,
                    args.norm_before_residual, args.warmup, args.weight_decay, args.max_steps, args.train_budget_s, k]
        path, meta = vocab_dir / name, vocab_dir / name / "run.json"
        if meta.exists() and json.loads(meta.read_text())["settings"] == json.loads(json.dumps(settings)):
            log(f"{name}: reusing the trained head in {path}")
            return load_eagle(path, target), json.loads(meta.read_text())["stats"]
        model, stats = train(target, examples, val_ex, ids, args, budget_s=args.train_budget_s * frac)
        save_eagle(model, path, torch.float32)
        stats["accepted_per_step"], stats["per_position"] = chain_estimate(model, val_ex, k, args.batch_tokens)
        stats["tokens"] = sum(e["ids"].numel() for e in examples)
        meta.write_text(json.dumps({"settings": settings, "stats": stats}))
        log(f"{name}: validation top-1 per step {[round(x, 3) for x in stats['val'][-1]] if stats['val'] else '-'}; "
            f"estimated greedy tokens per target step {stats['accepted_per_step']:.2f} (k={k})")
        return model, stats

    sizes = [min(int(s), target.cfg.vocab_size) for s in args.draft_vocab.split(",")]
    vocab_runs = []
    for size in sizes:
        ids = draft_vocabulary(train_ex, size, target.cfg.vocab_size, eos)
        cov = coverage(train_ex, ids)
        log(f"vocab: V_d={size} covers {cov:.3f} of the training response tokens")
        run = {"draft_vocab": size, "coverage": cov, "ids": ids, "share": args.vocab_share,
               "macs": draft_step_macs(target, size, args.ffn)}
        if len(sizes) > 1:
            try:
                _, stats = trained(share_of(args.vocab_share), ids, f"v{size}-share{args.vocab_share:g}", args.vocab_share)
            except torch.cuda.OutOfMemoryError:  # a full-vocabulary head at a GPU-sized batch
                log(f"vocab: V_d={size} ran out of GPU memory; left out of the comparison")
                torch.cuda.empty_cache()
                continue
            run.update(val_top1=stats["val"][-1] if stats["val"] else [], accepted_per_step=stats["accepted_per_step"],
                       tokens=stats["tokens"])
        vocab_runs.append(run)
    chosen = max(vocab_runs, key=lambda r: -1.0 if math.isnan(r.get("accepted_per_step", 0.0)) else r.get("accepted_per_step", 0.0))
    why = (f"the most estimated validation tokens per target step when each size was trained on {args.vocab_share:.0%} "
           "of the data" if len(sizes) > 1 else "the only size trained in this run")
    growth = []
    if len(sizes) > 1:
        growth.append({k_: chosen[k_] for k_ in ("tokens", "val_top1", "accepted_per_step")} | {"fraction": args.vocab_share})
    model, stats = trained(train_ex, chosen["ids"], f"v{chosen['draft_vocab']}", 1.0)
    growth.append({"fraction": 1.0, "tokens": stats["tokens"], "val_top1": stats["val"][-1] if stats["val"] else [],
                   "accepted_per_step": stats["accepted_per_step"]})
    if len(sizes) == 1:  # the one size's row is the full run
        chosen.update(val_top1=growth[-1]["val_top1"], accepted_per_step=stats["accepted_per_step"], share=1.0)

    # 6. save (bf16) and check it loads
    save_eagle(model, args.out)
    saved = load_eagle(args.out, target)
    log(f"saved {args.out} (V_d={model.config.draft_vocab_size})")
    info = {
        "aux_layers": list(saved.config.aux_layers), "draft_vocab": model.config.draft_vocab_size,
        "bytes": (args.out / "model.safetensors").stat().st_size, "num_rows": len(rows), "max_len": args.max_len,
        "generator": args.generator, "device_name": device_name(target.device), "self_prompts": self_info,
        "tf32": target.device.type == "cuda",
        "answers_per_prompt": args.answers_per_prompt, "max_tokens": args.max_tokens,
        "greedy_fraction": args.greedy_fraction, "temperature": args.temperature,
        "self_prompt_temperature": args.self_prompt_temperature,
        "train_tokens": sum(e["ids"].numel() for e in train_ex),
        "train_response_tokens": sum(e["ids"].numel() - e["prompt_len"] for e in train_ex),
        "val_keys": [rows[i]["key"] for i in sorted(val_idx)], "feature_s": feature_s, "steps": args.steps, "lr": args.lr, "clip": args.clip,
        "batch_tokens": args.batch_tokens, "epochs": args.epochs, "train": stats, "why": why,
        "vocab_runs": [{k_: v for k_, v in r.items() if k_ != "ids"} for r in vocab_runs], "growth": growth,
        "eval": {}, "k": k, "vocab_share": args.vocab_share, "argv": argv, "earlier_runs": earlier_runs,
    }

    write_info(args.out, info)

    # the data-growth points not trained yet (as time allows)
    for frac in [float(f) for f in args.fractions.split(",") if f]:
        if frac in {g["fraction"] for g in growth}:  # trained above
            continue
        if args.train_budget_s * frac > left() - 30:
            log(f"growth: no time left for the {frac:.0%} run")
            continue
        _, st = trained(share_of(frac), chosen["ids"], f"v{chosen['draft_vocab']}-share{frac:g}", frac)
        growth.append({"fraction": frac, "tokens": st["tokens"], "val_top1": st["val"][-1] if st["val"] else [],
                       "accepted_per_step": st["accepted_per_step"]})
    growth.sort(key=lambda r: r["fraction"])
    write_info(args.out, info)

    # 5. held-out evaluation with minispec (greedy speculative decoding) and the card
    if not args.skip_eval:
        info["eval"] = evaluate_held_out((target, tokenizer), bench, args)
        write_info(args.out, info)
    write_card(args.out, info)
    log(f"wrote {args.out / 'README.md'}")
    return info


def evaluate_held_out(target, bench: list[dict], args) -> dict:
    """Greedy speculative decoding at k on held-out bench prompts: this head, the distilled draft, n-gram."""
    held_out = eval_prompts(bench, args.eval_per_category)
    drafts = {"eagle (this head)": str(args.out), "distilled draft": str(args.draft), "ngram": "ngram"}
    args.kv_cache_gib = min(args.kv_cache_gib, 1.0)
    ev = evaluate_drafts(target, drafts, held_out, args)
    return {"prompts": len(held_out), "tokens": args.eval_tokens, "drafts": ev}


def card_only(args, argv: list[str]) -> dict:
    """--card-only: evaluate the head saved in --out (as training.json describes it) on held-out
    bench prompts, replay its greedy rounds on the validation answers where the corpus is in
    --cache-dir (with the saved, bf16 weights), and write its card."""
    info = json.loads((args.out / "training.json").read_text())
    target, tokenizer = load_checkpoint(args.target, dtype=torch.float32, device=args.device, backend="torch")
    bench = read_jsonl(args.prompts_dir / "bench.jsonl")
    corpus_file = args.cache_dir / "corpus.jsonl"
    if corpus_file.exists():
        by_key = {r["key"]: r for r in read_jsonl(corpus_file)}
        val = [by_key[k] for k in info["val_keys"] if k in by_key]
        head = load_eagle(args.out, target)
        examples = extract_features(target, [r for r in val if r["temperature"] == 0], head.config.aux_layers, info["max_len"])
        mean, per_position = chain_estimate(head, examples, info["k"])
        info["val_replay"] = {"answers": len(examples), "accepted_per_step": mean, "per_position": per_position}
        log(f"validation replay: {mean:.2f} tokens per target step over {len(examples)} greedy answers")
    info["eval"] = evaluate_held_out((target, tokenizer), bench, args)
    write_info(args.out, info)
    write_card(args.out, info)
    log(f"wrote {args.out / 'README.md'}")
    return info


def write_info(out: Path, info: dict) -> None:
    """training.json beside the head: every number its card shows."""
    (out / "training.json").write_text(json.dumps(info, indent=2, default=str))


def draft_step_macs(target: Transformer, draft_vocab: int, ffn: int | None) -> int:
    """Multiply-adds of one chained draft step (one token): the layer's q/k/v over 2H inputs, o_proj,
    the SwiGLU MLP and the H x V_d head (fc runs only in the catch-up pass)."""
    c = target.cfg
    H, D, I = c.hidden_size, c.head_dim, ffn or c.intermediate_size
    return 2 * H * (c.num_heads + 2 * c.num_kv_heads) * D + c.num_heads * D * H + 3 * H * I + H * draft_vocab


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


if __name__ == "__main__":
    main()
