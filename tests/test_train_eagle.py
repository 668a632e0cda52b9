"""training/train_eagle.py and the GPU corpus path of training/corpus.py: the teacher-forced
acceptance estimate counts what greedy speculative decoding would accept, and transformers'
batched generate (left padding, several batches) writes exactly the target's greedy answers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minispec import LLM, SamplingParams, load_checkpoint

SCRIPTS = Path(__file__).resolve().parents[1] / "training"
pytestmark = pytest.mark.usefixtures("one_thread")


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_hot_drafter(argmax: torch.Tensor, wrong: set[tuple[int, int]]):
    """A stand-in for unrolled_logits whose chained step i at index t proposes the target's argmax
    at t+i+1 (what greedy decoding accepts), except at the (i, t) in `wrong`."""
    def unrolled(model, ids, feats, steps):
        B, T = ids.shape
        for i in range(steps):
            logits = torch.zeros(B, T, 10)
            for t in range(T):
                if t + i + 1 < T and argmax[t + i + 1] >= 0:
                    logits[0, t, (argmax[t + i + 1] + (1 if (i, t) in wrong else 0)) % 10] = 1.0
            yield logits
    return unrolled


def test_chain_estimate_replays_greedy_rounds(monkeypatch):
    """An 8-token greedy row with a 2-token prompt (answer at indices 2..7), k = 4. The prefill is
    a round of one token (index 2) with no drafts; drafting rounds start at index 1 and never
    propose the last token (index 7). Right proposals except step 1 of the round at 1: rounds at
    1 (n = 1) and 3 (n = 2, stopped before index 7): 6 answer tokens in 3 rounds. A sampled row
    is ignored."""
    te = script("train_eagle")
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    argmax = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9])  # greedy: token t+1 is the argmax at t
    row = dict(ids=ids, prompt_len=2, argmax=argmax, features=torch.zeros(8, 3), last=torch.zeros(8, 1))
    sampled = dict(row, argmax=torch.full((8,), 5), greedy=False)
    model = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(layer=SimpleNamespace(hidden_size=1)),
                            fc=SimpleNamespace(in_features=3), draft_to_target=lambda x: x)
    monkeypatch.setattr(te, "unrolled_logits", one_hot_drafter(argmax, wrong={(1, 1)}))
    mean, per_position = te.chain_estimate(model, [dict(row, greedy=True), sampled], k=4)
    assert mean == pytest.approx(1 + (0 + 1 + 2) / 3)
    assert per_position == pytest.approx([2 / 2, 1 / 2, 0 / 1, 0.0])  # P(n > i | n >= i) over the drafting rounds n = 1, 2
    monkeypatch.setattr(te, "unrolled_logits", one_hot_drafter(argmax, wrong=set()))
    assert te.chain_estimate(model, [dict(row, greedy=True)], k=4)[0] == pytest.approx(1 + 4 / 2)  # the prefill, then n = 4 at 1
    short = dict(row, ids=ids[:3], argmax=argmax[:3], features=torch.zeros(3, 3), last=torch.zeros(3, 1), greedy=True)
    assert te.chain_estimate(model, [short], k=4) == (1.0, [0.0] * 4)  # one answer token: one round, nothing drafted


def test_runs_json_lists_each_command_once_oldest_first(tmp_path):
    te = script("train_eagle")
    runs = tmp_path / "runs.json"
    assert te.record_run(runs, ["--a"]) == []
    assert te.record_run(runs, ["--b"]) == [["--a"]]
    assert te.record_run(runs, ["--a"]) == [["--b"]]  # a rerun: listed once, as the latest
    assert json.loads(runs.read_text()) == [["--b"], ["--a"]]


def test_hf_generate_writes_the_targets_greedy_answers(tiny_llama):
    """Prompts of different lengths in batches of 2 (left-padded): every answer equals minispec's
    greedy answer, cut after EOS the same way; a spent time budget leaves prompts unanswered."""
    corpus = script("corpus")
    model, tokenizer = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    eos = corpus.stop_ids((model, tokenizer))
    prompts = [tokenizer.encode(t) for t in ("hello world", "the quick brown fox jumps", "a", "to be or not to be, that")]
    answers = dict(corpus.hf_generate(tiny_llama, prompts, [0.0] * len(prompts), 10, seed=0, batch_size=2, eos_ids=eos,
                                      device="cpu"))
    expected = LLM(model=str(tiny_llama), kv_cache_gib=0.01).generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    assert sorted(answers) == list(range(len(prompts)))
    assert [(answers[i].ids, answers[i].finish_reason) for i in range(len(prompts))] == [(o.token_ids, o.finish_reason) for o in expected]
    late = corpus.hf_generate(tiny_llama, prompts, [0.8] * len(prompts), 4, seed=0, batch_size=2, eos_ids=eos,
                              device="cpu", budget_s=1e-9)
    assert list(late) == []


def test_pipeline_end_to_end_with_the_hf_generator(checkpoint_factory, tiny_llama_draft, tmp_path):
    """prompts -> transformers-written corpus -> features -> two vocabulary sizes on a share ->
    the chosen size on all -> bf16 head minispec loads -> training.json; then --card-only adds the
    validation replay and the held-out evaluation and writes the card from them."""
    from minispec.io.eagle_checkpoint import load_eagle

    te = script("train_eagle")
    tiny_llama = checkpoint_factory("llama", seed=0, num_hidden_layers=6)  # default EAGLE layers 2, 3, 3
    out = tmp_path / "head"
    common = ["--target", str(tiny_llama), "--out", str(out), "--cache-dir", str(tmp_path / "cache" / "corpus"),
              "--device", "cpu", "--draft", str(tiny_llama_draft), "--eval-per-category", "1", "--eval-tokens", "6", "--kv-cache-gib", "0.01"]
    first = common + [
        "--generator", "hf", "--self-prompts-file", str(tmp_path / "self.jsonl"), "--num-self-prompts", "4",
        "--num-generate", "12", "--max-tokens", "12", "--gen-batch-size", "4", "--answers-per-prompt", "2",
        "--draft-vocab", "64,128", "--vocab-share", "0.5", "--fractions", "0.5", "--epochs", "1",
        "--batch-tokens", "256", "--max-len", "128", "--val-fraction", "0.25", "--log-every", "100", "--skip-eval"]
    info = te.main(first)
    assert info["earlier_runs"] == [] and json.loads((tmp_path / "cache" / "corpus" / "runs.json").read_text()) == [first]
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "training.json", "README.md"}
    target = minispec_target(tiny_llama)
    head = load_eagle(out, target)
    assert head.config.draft_vocab_size == info["draft_vocab"] in (64, 128)
    assert [r["draft_vocab"] for r in info["vocab_runs"]] == [64, 128]
    assert [g["fraction"] for g in info["growth"]] == [0.5, 1.0]
    assert info["num_rows"] > 12 and info["generator"] == "hf" and info["eval"] == {}  # two answers per prompt
    info = te.main(common + ["--card-only"])
    assert info["val_replay"]["answers"] >= 1 and info["val_replay"]["accepted_per_step"] >= 1.0
    assert set(info["eval"]["drafts"]) == {"eagle (this head)", "distilled draft", "ngram"}
    card = (out / "README.md").read_text()
    eagle = info["eval"]["drafts"]["eagle (this head)"]
    assert f"| eagle (this head) | {eagle['mean_accepted_per_step']:.2f} |" in card
    assert f"**{info['val_replay']['accepted_per_step']:.2f}**" in card
    assert f"python training/train_eagle.py {' '.join(first)}\n" in card  # the commands that made it, then the CPU step
    assert f"--card-only --target {tiny_llama} --out {out} --cache-dir {tmp_path / 'cache' / 'corpus'}" in card


def minispec_target(path):
    return load_checkpoint(path, dtype=torch.float32, device="cpu", backend="torch")[0]
