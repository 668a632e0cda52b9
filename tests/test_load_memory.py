"""A load holds the weights once: the checkpoint's tensors are copied into the model one at a time
(q/k/v and gate/up written straight into their fused tensors), the file's pages are let go as each
is copied, and prepacked layers keep only oneDNN's copy. Measured in a fresh process, whose peak
resident memory (VmHWM) may exceed what it held before loading by at most 1.25x the weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tokenizer
from minispec.fast.cpu_linear import cpu_matmul_candidates

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 1024, 2816, 6, 8, 4, 8192


def big_checkpoint(path: Path) -> int:
    """A random bf16 Llama of ~175 MB (untied head) in HF layout; returns its weight bytes."""
    path.mkdir()
    make_tokenizer(path)
    d = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HEADS * d, HIDDEN), p + "self_attn.k_proj.weight": (KV_HEADS * d, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * d, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HEADS * d),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER), p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1}))
    return sum(t.numel() * 2 for t in state.values())


PROBE = """
import os, sys, torch
from minispec import load_checkpoint
def kib(key):
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
load_checkpoint(sys.argv[3], dtype=sys.argv[2], device="cpu")  # what a first load imports and allocates once
before = kib("VmRSS")
model, _ = load_checkpoint(sys.argv[1], dtype=sys.argv[2], device="cpu")
print(before, kib("VmHWM"), model.cpu_matmul)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("matmul", ["linear", "prepacked", "upcast"])
def test_a_load_holds_the_weights_once(tmp_path, matmul, tiny_llama):
    """Per CPU kind (fast/cpu_caps.py): the bf16 variants this CPU offers are each loaded; the others
    are skipped by name (prepacked needs native bf16, upcast is for CPUs without it)."""
    if matmul not in cpu_matmul_candidates(torch.bfloat16):
        pytest.skip(f"{matmul} is not a bf16 matmul on this CPU kind (there: {cpu_matmul_candidates(torch.bfloat16)})")
    weight_bytes = big_checkpoint(tmp_path / "big")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "big"), "bfloat16", str(tiny_llama)], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "MINISPEC_CPU_MATMUL": matmul,
                                           "MINISPEC_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    before, peak, chosen = out.stdout.split()
    assert chosen == matmul
    grown = (int(peak) - int(before)) * 1024
    assert grown <= 1.25 * weight_bytes, f"peak grew by {grown / 2**20:.0f} MiB for {weight_bytes / 2**20:.0f} MiB of weights"
