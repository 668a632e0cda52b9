"""Random-init models of real shapes, built on a device from a seed: no file is read but the configs
and the shipped tokenizer, nothing is written. tools/gpu_measure.py times minispec's forwards on
them where the real weights cannot travel (the GPU machine has no network, and a command brings
64 MiB in all).

Shapes (config.json dicts, as `ModelConfig.from_hf` reads them):
    smollm2-135m     the default target (30 layers, width 576, tied embeddings)
    smollm2-draft    the shipped draft model's shape (weights/draft-smollm2)
    qwen2.5-1.5b     a Qwen2.5-1.5B-shaped target (28 layers, width 1536, 12 / 2 heads of 128, q/k/v biases)
    qwen2.5-0.5b     its 0.5B sibling's shape, the draft (24 layers, width 896, 14 / 2 heads of 64)
    llama-3.1-8b     a Llama-3.1-8B-shaped target (32 layers, width 4096, 32 / 8 heads of 128, untied)
and EAGLE-3 heads (`HEADS`: one decoder layer over the target's width; the 8B's with a 32,000-token
draft vocabulary and the target's MLP width, as EAGLE-3's Llama-3.1-8B head; SmolLM2's the
shipped head's config). Llama-3.1's RoPE scaling is left out: it changes no cost. Every vocabulary
is at least the shipped tokenizer's 49,152 ids, so the engine's prompts and checks work unchanged.
(A tiny model's vocabulary is `tiny_tokenizer`'s.)

`tiny(dims)` keeps a shape's kind (family, tied or not, biases) at a size a CPU runs in
milliseconds: what the dry run of tools/gpu_check.sh builds instead. Weights are N(0, 0.02),
norms 1, biases 0: throughput is real, acceptance means nothing (tools/controlled_pair.py makes a
pair whose acceptance it controls).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "weights" / "draft-smollm2"
VOCAB = 49152  # the shipped tokenizer's ids

SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "smollm2-draft": dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=256, intermediate_size=768,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
}
HEADS: dict[str, dict] = {  # target shape -> its EAGLE-3 head: draft vocabulary, MLP width, norm_before_residual
    "llama-3.1-8b": dict(draft_vocab_size=32000, intermediate_size=14336, norm_before_residual=False),
    "smollm2-135m": dict(draft_vocab_size=4096, intermediate_size=1536, norm_before_residual=True),
}


TINY_VOCAB = 512


def tiny(dims: dict) -> dict:
    """The same kind of model (family, tied head, biases) at a CPU's size: width 64, 4 heads of 16
    (2 KV heads), 4 layers (so an EAGLE head's default target layers 2, L//2, L-3 exist), and
    `tiny_tokenizer`'s 512 ids."""
    return {**dims, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": TINY_VOCAB}


def tiny_head(head: dict) -> dict:
    return {**head, "draft_vocab_size": 128, "intermediate_size": 128}


def hf_config(dims: dict, max_positions: int = 4096) -> dict:
    """A complete config.json dict (model_type, act, dtype, ids) around `dims`."""
    model_type = "qwen2" if dims["architectures"][0].startswith("Qwen2") else "llama"
    return {"model_type": model_type, "hidden_act": "silu", "max_position_embeddings": max_positions,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, **dims}


def shipped_tokenizer():
    from minispec.io.tokenizer import Tokenizer

    return Tokenizer.from_dir(TOKENIZER_DIR, json.loads((TOKENIZER_DIR / "config.json").read_text()))


def tiny_tokenizer():
    """A word-level tokenizer of TINY_VOCAB ids ("t0", "t1", ...; 1 BOS, 2 EOS), built in memory:
    a tiny model's vocabulary need not be the shipped tokenizer's 49,152 (nor its head that wide)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from minispec.io.tokenizer import Tokenizer

    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(tok, eos_token_ids=[2], bos_token_id=1)


def random_state(shapes: dict[str, torch.Size], seed: int, device: torch.device, dtype: torch.dtype,
                 std: float = 0.02) -> dict[str, torch.Tensor]:
    """N(0, std) weights drawn on `device` from one seeded generator (names in sorted order, so the
    same seed gives the same tensors), norms 1, biases 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, device=device, dtype=dtype)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape, device=device, dtype=dtype)
        else:
            state[name] = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(std)
    return state


def random_transformer(dims: dict, seed: int, device: torch.device, dtype: torch.dtype, max_positions: int = 4096):
    """A minispec `Transformer` of this shape with random weights, built on `device` (the loader's
    own build_model: the same fused layout a checkpoint gets)."""
    from minispec.io.checkpoint import build_model
    from minispec.model.config import ModelConfig
    from minispec.fast.fusion import checkpoint_state_dict
    from minispec.model.llama import Transformer

    cfg = ModelConfig.from_hf(hf_config(dims, max_positions))
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    shapes = {name: t.shape for name, t in checkpoint_state_dict(skeleton).items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return build_model(cfg, random_state(shapes, seed, device, dtype), dtype, device, where=f"random {dims['architectures'][0]}")


def random_eagle_head(target, head: dict, seed: int):
    """An EAGLE-3 head for `target` (its device and dtype) with random weights: one decoder layer
    of the target's attention shapes and `head`'s MLP width, reading target layers 2, L//2, L-3, its
    draft vocabulary the first draft_vocab_size ids (io/eagle_checkpoint.build_eagle: the loader's path)."""
    from minispec.io.eagle_checkpoint import build_eagle
    from minispec.model.eagle import EagleConfig, EagleModel, default_aux_layers
    from minispec.fast.fusion import checkpoint_state_dict

    t = target.cfg
    layer = replace(t, num_layers=1, intermediate_size=head["intermediate_size"], tie_word_embeddings=False,
                    qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None)
    cfg = EagleConfig(layer, head["draft_vocab_size"], t.hidden_size, default_aux_layers(t.num_layers),
                      head["norm_before_residual"])
    with torch.device("meta"):
        skeleton = EagleModel(cfg, torch.empty(0))
    shapes = {name: v.shape for name, v in checkpoint_state_dict(skeleton).items() if name not in ("d2t", "t2d")}
    state = random_state(shapes, seed, target.device, target.dtype)
    state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)  # draft id i is target id i
    state["t2d"] = torch.arange(t.vocab_size) < cfg.draft_vocab_size  # [V]
    return build_eagle(cfg, state, target, target.dtype, where="a random EAGLE-3 head")
