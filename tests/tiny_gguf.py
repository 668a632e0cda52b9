"""Tiny GGUF files written the way llama.cpp's converter writes them, for the tests.

`write_gguf` takes HF-named weights (`random_hf_state`) and a byte-level BPE (`train_tokenizer`)
and writes a GGUF: GGUF tensor names, q/k rows permuted for arch `llama` (llama.cpp's interleaved
RoPE), 2-D weights optionally quantized (Q8_0, Q4_1, ...), norms and biases F32, the tokenizer as
token/merge arrays in the metadata. Shared by test_gguf.py and test_transformers_coexistence.py.
"""

from __future__ import annotations

import json
import re

import gguf
import torch
from gguf import GGMLQuantizationType, TokenType
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "hello world, this is a test of the tokenizer and of speculative decoding.",
    "def add(a, b):\n    return a + b  # 1234\n",
    "café, über, naïve: non-ASCII text is split into bytes first.",
]
DIMS = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)  # head_dim 16


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: each head's rows i and i + D/2 become
    neighbours 2i, 2i+1, the pairs its interleaved RoPE rotates."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    """HF tensor name -> llama.cpp's, spelled out here independently of the loader's tables."""
    renames = [
        (r"^model\.embed_tokens\.", "token_embd."),
        (r"^model\.norm\.", "output_norm."),
        (r"^lm_head\.", "output."),
        (r"^model\.layers\.(\d+)\.", r"blk.\1."),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.self_attn\.q_proj\.", ".attn_q."),
        (r"\.self_attn\.k_proj\.", ".attn_k."),
        (r"\.self_attn\.v_proj\.", ".attn_v."),
        (r"\.self_attn\.o_proj\.", ".attn_output."),
        (r"\.mlp\.gate_proj\.", ".ffn_gate."),
        (r"\.mlp\.up_proj\.", ".ffn_up."),
        (r"\.mlp\.down_proj\.", ".ffn_down."),
    ]
    for pattern, repl in renames:
        hf_name = re.sub(pattern, repl, hf_name)
    return hf_name


def train_tokenizer() -> HFTokenizer:
    """A byte-level BPE (vocab 320) whose first ids are SmolLM2-style control tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def random_hf_state(arch: str, vocab: int, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights with noise everywhere (norm weights too), so no tensor can be swapped unnoticed."""
    g = torch.Generator().manual_seed(seed)
    h, f, head_dim = DIMS["hidden"], DIMS["intermediate"], DIMS["hidden"] // DIMS["heads"]
    q_rows, kv_rows = DIMS["heads"] * head_dim, DIMS["kv_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(DIMS["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_rows, h),
            p + "self_attn.k_proj.weight": (kv_rows, h),
            p + "self_attn.v_proj.weight": (kv_rows, h),
            p + "self_attn.o_proj.weight": (h, q_rows),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
    state = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=g)
        state[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise  # [out, in] or [n]
    return state


def write_gguf(
    path, arch: str, state: dict, tok: HFTokenizer, qtype=GGMLQuantizationType.F32, skip=(), pre="gpt2", add_bos=False
):
    """Write `state` (HF names) as llama.cpp would: GGUF names, q/k permuted for llama, 2-D weights
    quantized to `qtype`, norms and biases F32, tokenizer arrays in the metadata."""
    head_dim = DIMS["hidden"] // DIMS["heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(DIMS["layers"])
    w.add_context_length(256)
    w.add_embedding_length(DIMS["hidden"])
    w.add_feed_forward_length(DIMS["intermediate"])
    w.add_head_count(DIMS["heads"])
    w.add_head_count_kv(DIMS["kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)  # by id
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) for m in model["merges"]])
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)

    for name, tensor in state.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")) and arch == "llama":
            tensor = llama_cpp_permute(tensor, DIMS["heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")) and arch == "llama":
            tensor = llama_cpp_permute(tensor, DIMS["kv_heads"])
        if gguf_name(name) in skip:
            continue
        data = tensor.numpy()
        if data.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)  # uint8 blocks
        else:
            w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


