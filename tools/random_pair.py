"""Build a random-init target / draft pair of realistic size for throughput runs where the real
target cannot travel (the GPU check carries at most 64 MiB; SmolLM2's GGUF alone is 98 MB).

Both use the shipped draft's tokenizer (weights/draft-smollm2, 49,152 tokens), so bench.py's
prompts and the n-gram drafter work unchanged. Random weights make acceptance meaningless (take it
from the CPU runs on the real pair); step times, verification cost and kernel behaviour are real.

    python tools/random_pair.py OUT_DIR [--size 1b|tiny] [--device cuda]
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
SIZES = {  # Llama-3.2-1B-like target with a 4-layer draft; "tiny" for a CPU dry run
    "1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8), dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                                             num_attention_heads=12, num_key_value_heads=4)),
    "tiny": (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2), dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1)),
}


def write_model(out: Path, dims: dict, seed: int, device: str) -> None:
    """A LlamaForCausalLM directory with N(0, 0.02) weights (norms 1), bf16, untied head."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((TOKENIZER_DIR / "config.json").read_text())["vocab_size"]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_act": "silu",
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, **dims}
    h, f, n = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    d = h // dims["num_attention_heads"]
    kv = dims["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {name: (torch.ones(shape, device=device) if name.endswith("norm.weight")
                    else torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
             for name, shape in shapes.items()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    target, draft = SIZES[args.size]
    write_model(args.out / "target", target, 0, args.device)
    write_model(args.out / "draft", draft, 1, args.device)
    print(f"wrote {args.out / 'target'} and {args.out / 'draft'} ({args.size})")


if __name__ == "__main__":
    main()
