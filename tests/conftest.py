"""Shared fixtures: tiny random-init checkpoints in Hugging Face format, built offline.

`make_checkpoint(dir, arch, **overrides)` saves a random `transformers` model (config.json +
model.safetensors) with a real tokenizer.json (a byte-level BPE trained here on a few sentences),
so the loader, the tokenizer and parity with transformers are all tested on real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "hello world, this is a test of the tokenizer and of speculative decoding.",
    "def add(a, b):\n    return a + b\n",
    "to be or not to be, that is the question.",
    "a draft model proposes tokens and the target model verifies them in one pass.",
]

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def make_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on CORPUS and save path/tokenizer.json. Returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def make_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random-init `arch` model with a tokenizer to `path`; returns path.

    Defaults: hidden 64, 2 layers, 4 query heads / 2 KV heads (GQA), fp32. `overrides` go into
    the transformers config (e.g. tie_word_embeddings, rope_scaling, sliding_window, num_hidden_layers).
    """
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(path)
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    model.save_pretrained(path)
    return path


def pytest_terminal_summary(terminalreporter) -> None:
    """Name the resolved versions of what moves under us, so every CI log shows them."""
    import importlib.metadata

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    names = ("torch", "triton", "transformers", "kernels", "tokenizers", "gguf", "hypothesis")
    terminalreporter.write_line("versions: " + ", ".join(f"{n} {version(n)}" for n in names))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """checkpoint_factory(arch="llama", **overrides) -> Path, cached per argument set."""
    cache: dict = {}

    def build(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(arch), arch, seed, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_factory) -> Path:
    """A 2-layer GQA Llama target."""
    return checkpoint_factory("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_draft(checkpoint_factory) -> Path:
    """A 1-layer Llama with the same tokenizer as tiny_llama, different random weights: a poor draft."""
    return checkpoint_factory("llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one intra-op torch thread, restoring the setting afterwards.

    The test models are tiny, so a second OpenMP thread buys nothing, and on a shared 2-core
    machine two spinning OpenMP threads per process contend badly (a 24-token generate measured
    0.5 s with one thread, 13 s with two, under load). Use: `pytestmark = pytest.mark.usefixtures("one_thread")`.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_eagle(tiny_llama, tmp_path_factory) -> Path:
    """A random-init EAGLE-3 head for tiny_llama in the official checkpoint layout (fp32): it reads
    the target's layers 0, 1, 2 (2 = the last layer's output) and drafts from the even token ids
    (half the vocabulary, so the target often puts mass outside the draft's)."""
    from minispec import load_checkpoint
    from minispec.io.eagle_checkpoint import save_eagle
    from minispec.model.eagle import init_eagle

    target, _ = load_checkpoint(tiny_llama, dtype="float32", device="cpu")
    eagle = init_eagle(target, torch.arange(0, target.cfg.vocab_size, 2), aux_layers=(0, 1, 2), seed=3)
    path = tmp_path_factory.mktemp("eagle")
    save_eagle(eagle, path, torch.float32)
    return path

