"""Smoke tests of scripts/distill.py (the default draft's training pipeline) on a tiny model.

What they pin down: the bench and training prompt sets never share a subject; the draft's
embedding initialisation is the target embedding's best low-rank approximation; the training
forward (minispec's modules + dense causal SDPA) lowers the loss; and the whole pipeline, run
end to end on a tiny random target, writes a bf16 checkpoint that `minispec.load_checkpoint`
loads and whose minispec logits equal the training forward's.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest
import torch

import minispec

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


distill = _load("distill")
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


def test_projected_embedding_is_the_best_low_rank_approximation():
    """The projected [V, k] embedding has the top-k singular values of the target's [V, H]
    embedding, so E_d @ E_d.T is the optimal rank-k approximation of E @ E.T (token similarities
    the tied head starts from)."""
    torch.manual_seed(0)
    emb = torch.randn(300, 24) @ torch.randn(24, 24)  # [V, H], anisotropic like a real embedding
    projected = distill.projected_embedding(emb, 8)  # [V, 8]
    top = torch.linalg.svdvals(emb)[:8]
    torch.testing.assert_close(torch.linalg.svdvals(projected), top, rtol=1e-4, atol=1e-4)


def test_training_forward_lowers_the_response_loss(tiny_llama):
    """A few AdamW steps on a handful of fixed sequences lower the cross entropy on their
    response tokens by more than 1 nat (from about ln(vocab) at initialisation)."""
    target, _ = minispec.load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu", backend="torch")
    hf_cfg = json.loads((tiny_llama / "config.json").read_text())
    args = distill.parse_args(["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
                               "--epochs", "15", "--batch-size", "4", "--lr", "1e-2", "--log-every", "1000"])
    cfg = distill.draft_hf_config(args, hf_cfg)
    model = distill.init_draft(cfg, target.embed_tokens.weight.detach(), seed=0)
    rng = random.Random(0)
    vocab = hf_cfg["vocab_size"]
    rows = [{"prompt_ids": [rng.randrange(vocab) for _ in range(6)], "output_ids": [rng.randrange(vocab) for _ in range(10)]}
            for _ in range(8)]
    examples = distill.make_examples(rows, max_len=64)
    before = distill.evaluate_loss(model, examples, batch_size=4)
    stats = distill.train_draft(model, examples, [], args)
    after = distill.evaluate_loss(model, examples, batch_size=4)
    assert stats["steps"] == 30
    assert after < before - 1.0, (before, after)


def test_pipeline_end_to_end_writes_a_draft_minispec_loads(tiny_llama, tmp_path):
    """prompts -> minispec-generated corpus -> training -> bf16 checkpoint -> eval -> card, on a
    tiny random target. The saved draft loads with the target's tokenizer files, its minispec
    logits match the training forward, and the card reports the acceptance numbers."""
    out = tmp_path / "draft"
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
    assert info["num_prompts"] == 8 and len(info["val_ids"]) == 2
    assert set(info["eval"]) == {"distilled", "naive-1-layers", "ngram"}
    for metrics in info["eval"].values():
        assert 0.0 <= metrics["acceptance_rate"] <= 1.0 and metrics["generated_tokens"] > 0
    card = (out / "README.md").read_text()
    assert f"{info['eval']['distilled']['acceptance_rate']:.3f}" in card and "Apache-2.0" in card
    # The corpus is cached row by row (a rerun or a longer run reuses it).
    rows = (tmp_path / "cache" / "corpus.jsonl").read_text().splitlines()
    assert len(rows) == 8
