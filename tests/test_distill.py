"""Smoke tests of training/distill.py (the default draft's training pipeline) on a tiny model.

What they pin down: the bench and training prompt sets never share a subject (nor do the
prompts the target writes itself: no 5-word run in common with a bench prompt); the draft's
embedding initialisation is the target embedding's best low-rank approximation; the training
loss is the forward KL to the target over its top-k tokens plus a lumped tail, and training on it
(minispec's modules + dense causal SDPA) lowers it; and the whole pipeline, run
end to end on a tiny random target, writes a bf16 checkpoint that `minispec.load_checkpoint`
loads and whose minispec logits equal the training forward's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

import minispec

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPTS = Path(__file__).resolve().parents[1] / "training"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


distill = _load("distill")
corpus = _load("corpus")
make_prompts = _load("make_prompts")


def test_bench_and_train_prompts_share_no_subject():
    """Every topic, coding task and passage goes to exactly one set, so a bench prompt's subject
    (not only its text) is unseen in training; the bench has 8 prompts per category."""
    train, bench = make_prompts.build_prompts(num_train=256, seed=0)
    assert len(train) == 256
    counts = {c: sum(p["category"] == c for p in bench) for c in make_prompts.BENCH_CATEGORIES}
    assert counts == {c: make_prompts.BENCH_PER_CATEGORY for c in make_prompts.BENCH_CATEGORIES}
    subjects = {  # category -> the subjects its prompts are built on
        ("explain", "list", "qa"): make_prompts.TOPICS,
        ("code",): [task for _, task in make_prompts.CODE_TASKS],
        ("rewrite", "summarise"): make_prompts.PASSAGES,
        ("chat",): make_prompts.CHAT_OPENERS,
    }
    for categories, items in subjects.items():
        for subject in items:
            pattern = re.compile(rf"\b{re.escape(subject)}\b")
            in_bench = any(p["category"] in categories and pattern.search(p["prompt"]) for p in bench)
            in_train = any(p["category"] in categories and pattern.search(p["prompt"]) for p in train)
            assert not (in_bench and in_train), f"subject {subject[:40]!r} is in both sets"
    assert len({p["id"] for p in train + bench}) == len(train) + len(bench)


def test_user_turn_header_is_the_chat_template_up_to_the_user_message():
    """What the target is fed to write a prompt itself: its template's system turn and a user
    turn's opening, so that its continuation is a user's message (the shipped ChatML template)."""
    _, tokenizer = minispec.load_checkpoint(Path(__file__).resolve().parents[1] / "weights" / "draft-smollm2",
                                            device="cpu", backend="torch")
    header = corpus.user_turn_header(tokenizer)
    assert header.startswith("<|im_start|>system\n") and header.endswith("<|im_end|>\n<|im_start|>user\n")
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert full.startswith(header + "Hello there<|im_end|>")


def test_keep_self_prompts_drops_cut_empty_repeated_and_bench_overlapping_messages():
    """Only messages the target closed itself, once each, and with no 5-word run in common with
    a bench prompt (case-insensitive) become training prompts."""
    from types import SimpleNamespace

    bench = [{"prompt": "Summarise the following passage in two sentences: tides rise twice a day."}]
    texts = [
        ("How do bees make honey?", "eos"),  # kept
        ("Tell me a story about a dragon who", "length"),  # cut at the token limit
        ("   ", "eos"),  # empty
        ("How do bees make honey?", "eos"),  # repeated
        ("Please summarise THE FOLLOWING PASSAGE IN TWO words.", "eos"),  # 5 words shared with the bench
        ("Summarise the following passage, in short.", "eos"),  # 3 words shared only: kept
    ]
    outputs = [SimpleNamespace(index=i, text=t, finish_reason=r) for i, (t, r) in enumerate(texts)]
    rows = corpus.keep_self_prompts(outputs, bench)
    assert rows == [
        {"id": "self-00000", "category": "self", "prompt": "How do bees make honey?"},
        {"id": "self-00005", "category": "self", "prompt": "Summarise the following passage, in short."},
    ]


def test_shipped_self_prompts_share_no_five_word_run_with_the_bench():
    """The shipped self.jsonl (the default draft's self-written prompts) passes the same filter
    whole: distinct, non-empty, and no 5-word run in common with a bench prompt."""
    from types import SimpleNamespace

    prompts = Path(__file__).resolve().parents[1] / "weights" / "prompts"
    own, bench = make_prompts.read_jsonl(prompts / "self.jsonl"), make_prompts.read_jsonl(prompts / "bench.jsonl")
    outputs = [SimpleNamespace(index=i, text=p["prompt"], finish_reason="eos") for i, p in enumerate(own)]
    assert len(own) > 1000
    assert [r["prompt"] for r in corpus.keep_self_prompts(outputs, bench)] == [p["prompt"] for p in own]


def test_projected_embedding_is_the_best_low_rank_approximation():
    """The projected [V, k] embedding has the top-k singular values of the target's [V, H]
    embedding, so E_d @ E_d.T is the optimal rank-k approximation of E @ E.T (token similarities
    the tied head starts from)."""
    torch.manual_seed(0)
    emb = torch.randn(300, 24) @ torch.randn(24, 24)  # [V, H], anisotropic like a real embedding
    projected = distill.projected_embedding(emb, 8)  # [V, 8]
    top = torch.linalg.svdvals(emb)[:8]
    torch.testing.assert_close(torch.linalg.svdvals(projected), top, rtol=1e-4, atol=1e-4)


def soft_examples(target, rows, k, sharpen=1.0):
    """Training examples (ids, first response index, top-k ids, top-k log-probs) whose soft
    labels come from a teacher-forced forward of `target` (what generation's logprobs return),
    its logits times `sharpen` (the random tiny target is nearly uniform; a real one is not)."""
    out = []
    for r in rows:
        ids = r["prompt_ids"] + r["output_ids"]
        with torch.no_grad():
            logits = target(torch.tensor(ids), minispec.BatchMetadata.for_prompts([len(ids)]))  # [L, V]
            lp = (sharpen * logits).log_softmax(-1)
        values, top = lp[len(r["prompt_ids"]) - 1 : len(ids) - 1].topk(k)  # positions predicting the response
        out.append((ids, len(r["prompt_ids"]), top, values))
    return out


def tiny_setup(tiny_llama, epochs=15):
    target, _ = minispec.load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu", backend="torch")
    hf_cfg = json.loads((tiny_llama / "config.json").read_text())
    args = distill.parse_args(["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
                               "--epochs", str(epochs), "--batch-size", "4", "--lr", "1e-2", "--log-every", "1000"])
    cfg = distill.draft_hf_config(args, hf_cfg)
    model = distill.init_draft(cfg, target.embed_tokens.weight.detach(), seed=0)
    rng = random.Random(0)
    vocab = hf_cfg["vocab_size"]
    rows = [{"prompt_ids": [rng.randrange(vocab) for _ in range(6)], "output_ids": [rng.randrange(vocab) for _ in range(10)]}
            for _ in range(8)]
    return target, model, rows, args


@pytest.mark.parametrize("k", [5, "vocab"])
def test_distillation_kl_is_the_lumped_forward_kl(tiny_llama, k):
    """batch_loss's KL equals KL(p || q) over the target's top-k tokens plus one lumped rest
    bucket, computed here from the full distributions; with k = vocab it is the full KL."""
    target, model, rows, _ = tiny_setup(tiny_llama)
    k = target.cfg.vocab_size if k == "vocab" else k
    examples = soft_examples(target, rows[:2], k)
    _, m = distill.batch_loss(model, examples, hard_weight=0.0)
    expected = []
    for ids, first, top, _ in examples:
        with torch.no_grad():
            full_p = target(torch.tensor(ids), minispec.BatchMetadata.for_prompts([len(ids)])).double().softmax(-1)
            full_q = model.lm_head(distill.hidden_states(model, torch.tensor(ids)[None]))[0].double().softmax(-1)
        p, q = full_p[first - 1 : len(ids) - 1], full_q[first - 1 : len(ids) - 1]  # [n, V]
        p_top, q_top = p.gather(-1, top), q.gather(-1, top)
        p_rest, q_rest = (1 - p_top.sum(-1)).clamp(min=0), 1 - q_top.sum(-1)
        kl = (p_top * (p_top / q_top).log()).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.clamp(min=math.exp(-100)).log()
        if k == target.cfg.vocab_size:
            torch.testing.assert_close(kl, (p * (p / q).log()).sum(-1))
        expected.append(kl)
    assert m["kl"] == pytest.approx(torch.cat(expected).mean().item(), rel=1e-4, abs=1e-5)
    assert m["tokens"] == 20


def test_training_lowers_the_kl_and_raises_top1_agreement(tiny_llama):
    """A few AdamW steps on fixed sequences with (sharpened) soft labels from the tiny target cut
    the KL to the target by more than half and raise top-1 agreement with its argmax by > 0.3."""
    target, model, rows, args = tiny_setup(tiny_llama)
    examples = soft_examples(target, rows, 8, sharpen=30.0)
    before = distill.evaluate(model, examples, batch_size=4)
    stats = distill.train_draft(model, examples, [], args)
    after = distill.evaluate(model, examples, batch_size=4)
    assert stats["steps"] == 30
    assert after["kl"] < 0.5 * before["kl"], (before, after)
    assert after["top1"] > before["top1"] + 0.3, (before, after)


def test_pipeline_end_to_end_writes_a_draft_minispec_loads(tiny_llama, tmp_path):
    """prompts -> minispec-generated corpus -> training -> bf16 checkpoint -> eval -> card, on a
    tiny random target. The saved draft loads with the target's tokenizer files, its minispec
    logits match the training forward, and the card reports the acceptance numbers."""
    out = tmp_path / "draft"
    own = [{"id": "self-00003", "category": "self", "prompt": "What is a prime number?"}]
    make_prompts.write_jsonl(tmp_path / "prompts" / "self.jsonl", own)  # read as it is, like the shipped file
    info = distill.main([
        "--target", str(tiny_llama), "--out", str(out), "--prompts-dir", str(tmp_path / "prompts"),
        "--cache-dir", str(tmp_path / "cache"), "--num-train", "16", "--num-generate", "8", "--max-tokens", "8",
        "--gen-batch-size", "8", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
        "--max-pos", "512", "--epochs", "2", "--batch-size", "4", "--val-fraction", "0.25", "--log-every", "100",
        "--eval-per-category", "1", "--eval-tokens", "6", "--naive-layers", "1", "--kv-cache-gib", "0.01",
    ])
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "README.md"}
    draft, tokenizer = minispec.load_checkpoint(out, device="cpu", backend="torch")
    assert draft.cfg.num_layers == 1 and draft.cfg.hidden_size == 32 and draft.cfg.tie_word_embeddings
    assert draft.cfg.dtype == torch.bfloat16
    assert tokenizer.get_vocab() == minispec.load_checkpoint(tiny_llama, device="cpu")[1].get_vocab()
    assert info["logit_check"] < 1e-4
    # Prompts too long for the tiny target's 512-token context are skipped, not fatal.
    assert info["num_prompts"] + info["num_skipped"] == 9 and info["num_prompts"] >= 4
    assert info["num_self"] == 1  # the self-written prompt was answered too
    assert len(info["val_ids"]) == int(0.25 * info["num_prompts"])
    assert set(info["eval"]) == {"distilled", "naive-1-layers", "ngram"}
    for metrics in info["eval"].values():
        assert 0.0 <= metrics["acceptance_rate"] <= 1.0 and metrics["generated_tokens"] > 0
    card = (out / "README.md").read_text()
    assert f"{info['eval']['distilled']['acceptance_rate']:.3f}" in card and "Apache-2.0" in card
    assert "- 1 from `weights/prompts/self.jsonl`" in card and "of which 1 were kept" in card
    kls = [v["kl"] for v in info["train"]["val"]]  # the card's verdict follows the last two validation KLs
    assert ("it is undertrained" in card) == (kls[-1] < kls[-2]) != ("more data, not more steps" in card)
    # The corpus is cached row by row (a rerun or a longer run reuses it).
    rows = [json.loads(line) for line in (tmp_path / "cache" / "corpus.jsonl").read_text().splitlines()]
    assert len(rows) == info["num_prompts"]
    # ...with the target's top-k log-probabilities for every response token (the soft labels).
    for r in rows:
        ids, lps = corpus.load_soft_labels(tmp_path / "cache" / "soft" / f"{r['key']}.safetensors")
        assert ids.shape == lps.shape == (len(r["output_ids"]), 20)
        assert (lps[:, :-1] >= lps[:, 1:]).all() and (lps.exp().sum(-1) <= 1 + 1e-5).all()


def lumped_kl_loss_autograd(h, weight, soft_ids, soft_lp, labels, hard_weight):
    """The same loss as distill.lumped_kl_head written as plain autograd over the full logits."""
    logits = h @ weight.T  # [N, V]
    log_q = logits.log_softmax(-1)
    log_q_top = log_q.gather(-1, soft_ids)
    log_q_rest = log_q.scatter(-1, soft_ids, float("-inf")).logsumexp(-1).clamp(min=-100.0)
    p_top = soft_lp.exp()
    p_rest = (1 - p_top.sum(-1)).clamp(min=0)
    kl = (p_top * (soft_lp - log_q_top)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * log_q_rest
    hard = -log_q.gather(-1, labels[:, None])[:, 0]
    return kl.mean() + hard_weight * hard.mean(), kl, hard


@pytest.mark.parametrize("k,hard_weight", [(4, 0.0), (4, 0.5), (40, 0.0)])
def test_fused_kl_head_matches_autograd(k, hard_weight):
    """The fused head (loss and gradient in one chunked pass) gives autograd's loss, per-row KL
    and cross entropy, and gradients for the hidden states and the head, over several chunks;
    k = 40 = V is the full-vocabulary KL (empty tail)."""
    torch.manual_seed(0)
    n, hidden, vocab = 300, 16, 40
    h = (2 * torch.randn(n, hidden, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(vocab, hidden, dtype=torch.float64).requires_grad_()
    target_logits = 3 * torch.randn(n, vocab, dtype=torch.float64)
    soft_lp, soft_ids = target_logits.log_softmax(-1).topk(k)
    labels = torch.randint(0, vocab, (n,))
    loss, kl, hard, top1 = distill.LumpedKLHead.apply(h, weight, soft_ids, soft_lp, labels, hard_weight)
    grads = torch.autograd.grad(loss, (h, weight))
    ref_loss, ref_kl, ref_hard = lumped_kl_loss_autograd(h, weight, soft_ids, soft_lp, labels, hard_weight)
    ref_grads = torch.autograd.grad(ref_loss, (h, weight))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(kl, ref_kl.detach())
    torch.testing.assert_close(hard, ref_hard.detach())
    torch.testing.assert_close(top1, (h @ weight.T).argmax(-1) == soft_ids[:, 0])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    assert kl.min() >= -1e-9 and grads[0].abs().sum() > 0


def test_asking_for_more_self_prompts_extends_the_file_as_one_run_would_have_written_it(tmp_path):
    """--num-self-prompts above what self.json says was asked writes only the missing messages and
    appends them: with minispec's engine (message i seeded seed + 1e6 + i) 3 then 6 gives the same
    rows, ids and counts as 6 at once, so corpus answers keyed by the earlier rows stay valid. (One
    request at a time: a sampled fp32 message may change with its batch's size, as GEMM rounding
    does; the int8 path is the bitwise batch-invariant one.)"""
    from types import SimpleNamespace

    draft = minispec.load_checkpoint(Path(__file__).resolve().parents[1] / "weights" / "draft-smollm2",
                                     dtype=torch.float32, device="cpu")

    def prompts_for(n: int, name: str, temperature: float = 1.0) -> tuple[list[dict], dict]:
        args = SimpleNamespace(prompts_dir=SCRIPTS.parent / "weights" / "prompts", rebuild_prompts=False, num_generate=0,
                               self_prompts_file=tmp_path / name, num_self_prompts=n, answers_per_prompt=1, seed=11,
                               generator="minispec", gen_batch_size=1, kv_cache_gib=0.05, self_prompt_tokens=40,
                               self_prompt_temperature=temperature, target=None, device="cpu")
        _, _, _, info = corpus.load_prompts(args, draft)
        return make_prompts.read_jsonl(tmp_path / name), info

    once, once_info = prompts_for(6, "once.jsonl")
    prompts_for(3, "twice.jsonl")
    twice, twice_info = prompts_for(6, "twice.jsonl")
    assert once and twice == once
    assert any(int(p["id"].removeprefix("self-")) >= 3 for p in twice)  # rows the extension appended
    assert once_info["asked"] == twice_info["asked"] == 6 and once_info["kept"] == twice_info["kept"] == len(once)
    assert len({p["id"] for p in once}) == len(once)
    with pytest.raises(SystemExit, match="was written with"):  # other settings would mix two kinds of prompt
        prompts_for(9, "twice.jsonl", temperature=0.7)
