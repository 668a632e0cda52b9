"""Build a random-init target (and draft) of realistic size for throughput runs where the real target
cannot travel: tools/gpu_check.sh writes one on the GPU machine, where nothing can be downloaded and
every file a command brings counts against its 64 MiB (SmolLM2's GGUF alone is 98 MB).

Sizes: "smollm2" is a target of SmolLM2-135M-Instruct's exact shape (30 layers, width 576, tied
embeddings), for which the shipped draft (weights/draft-smollm2) and EAGLE-3 head
(weights/eagle-smollm2) fit as they are, so the check benches the default pair's drafters on the
default target's shapes; no draft is written. "1b" is a Llama-3.2-1B-like target with a random
4-layer draft; "tiny" a small pair for a CPU dry run. Every model uses the shipped draft's
tokenizer (49,152 tokens), so bench.py's prompts and the n-gram drafter work unchanged.

Random weights make acceptance meaningless (take it from the CPU runs on the real pair); step
times, the cost of a verification and of a drafted token, and kernel behaviour are real.

    python tools/random_pair.py OUT_DIR [--size smollm2|1b|tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "weights" / "draft-smollm2"
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
               tie_word_embeddings=True)
SIZES = {  # name -> (target's config, draft's config or None: the shipped drafters fit the target)
    "smollm2": (SMOLLM2, None),
    "1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8), dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                                             num_attention_heads=12, num_key_value_heads=4)),
    "tiny": (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2), dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1)),
}


def model_config(dims: dict) -> dict:
    """The config.json of a bf16 LlamaForCausalLM with these dims over the shipped tokenizer's vocabulary
    (untied head, RoPE base 10,000 and 4,096 positions unless `dims` says otherwise)."""
    vocab = json.loads((TOKENIZER_DIR / "config.json").read_text())["vocab_size"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, **dims}


def write_model(out: Path, dims: dict, seed: int, device: str) -> None:
    """A LlamaForCausalLM directory with N(0, 0.02) weights (norms 1), bf16, with the shipped tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(dims)
    h, f, n, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(n):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {name: (torch.ones(shape, device=device) if name.endswith("norm.weight")
                    else torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
             for name, shape in shapes.items()}
    save_file(state, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))  # last: its presence means the directory is complete


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="smollm2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the random numbers are drawn (cuda: seconds for a 1B model)")
    args = ap.parse_args()
    target, draft = SIZES[args.size]
    write_model(args.out / "target", target, 0, args.device)
    if draft is not None:
        write_model(args.out / "draft", draft, 1, args.device)
    drafts = f"and {args.out / 'draft'}" if draft else "(drafters: the shipped ones)"
    print(f"wrote {args.out / 'target'} {drafts} ({args.size})")


if __name__ == "__main__":
    main()
