"""Read a GGUF file (llama.cpp's single-file checkpoint) into what an HF checkpoint directory holds:
a `config.json` dict, a state dict under HF tensor names (dequantized to fp32), and a tokenizer.

The `gguf` package parses the file and dequantizes (`GGUFReader`, `gguf.quants.dequantize`); this
module only translates llama.cpp's conventions back to Hugging Face's. It is the only module that
imports `gguf`, and it is imported only when a .gguf file is read, so an environment without the
package (a GPU image that cannot install it) runs everything else:

- Names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, and so on (tables below).
- Shapes: GGUF lists dims fastest-first (`tensor.shape == [in_features, out_features]`), the reverse
  of torch; `dequantize` already returns the torch order, which we check against the reversed dims.
- RoPE layout: for arch `llama`, llama.cpp rotates adjacent pairs (2i, 2i+1) of each head while HF
  rotates the two halves (i, i + D/2), so its converter permutes the output rows of q_proj and
  k_proj. `unpermute_rows` undoes that exactly. Qwen2 is stored unpermuted (llama.cpp runs it
  with the halves layout, "NEOX" RoPE).
- Tokenizer: GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is rebuilt from the token
  and merge arrays in the metadata. A `tokenizer.json` lying beside the .gguf file wins over that.

Caveats: only the `llama` and `qwen2` archs, no SentencePiece (`"llama"`) tokenizers, no Llama-3.1
RoPE factors (`rope_freqs.weight`), no YaRN. Each raises ValueError naming what is unsupported.
No sliding window is read: llama.cpp stores a Mistral as arch `llama` without one, so it runs
full attention, as in llama.cpp (Hugging Face's Mistral-7B-v0.1 masks beyond 4096 tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

try:  # only this module needs `gguf`: minispec imports, and loads checkpoint directories, without it
    from gguf import GGMLQuantizationType, GGUFReader, TokenType
    from gguf.quants import dequantize
    from gguf.quants import _type_traits as GGUF_QUANTS  # the quant types the gguf package dequantizes
except ImportError as e:
    raise ImportError(
        f"reading a .gguf file needs the `gguf` package, which cannot be imported here ({e}); install it with "
        "`pip install 'gguf>=0.10'`, or convert the file where it is installed (python -m minispec.io.convert "
        "FILE.gguf DIR) and load the directory", name="gguf") from e
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from .tokenizer import Tokenizer

# general.architecture -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}

# GGUF tensor names (without .weight/.bias) -> HF module names
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {  # inside blk.N / model.layers.N
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}

QUANT_TYPES = frozenset(GGUF_QUANTS)

# tokenizer.ggml.pre -> how text is split before BPE (the regexes of the models' own tokenizer.json)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),  # GPT-2 regex
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence(  # GPT-2 regex, every digit on its own
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    ),
    "qwen2": lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict, dict[str, torch.Tensor], Tokenizer]:
    """(HF config.json dict, state dict with HF names in `dtype`, Tokenizer) from a .gguf file."""
    reader, arch = open_checked(Path(path))
    hf_config = gguf_config(reader, arch)
    return hf_config, gguf_state_dict(reader, arch, hf_config, dtype), gguf_tokenizer(reader, Path(path))


def read_gguf_header(path: str | Path) -> tuple[dict, Tokenizer]:
    """(HF config dict, Tokenizer) of a .gguf file, no weights read (its tensor types checked)."""
    reader, arch = open_checked(Path(path))
    return gguf_config(reader, arch), gguf_tokenizer(reader, Path(path))


def open_checked(path: Path) -> tuple[GGUFReader, str]:
    """(reader, arch) of a GGUF file whose architecture and every tensor type can be read here (a
    ValueError naming what cannot: before any tensor is dequantized)."""
    reader = open_gguf(path)
    arch = _require(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} in {path.name} is not supported (supported: {sorted(GGUF_ARCHITECTURES)})")
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *QUANT_TYPES}
    unknown = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if unknown:
        example = next(t.name for t in reader.tensors if t.tensor_type.name == unknown[0])
        raise ValueError(f"{path.name}: GGUF tensor type {', '.join(unknown)} (e.g. {example!r}) cannot be read here "
                         f"(readable: F32, F16, {', '.join(sorted(q.name for q in QUANT_TYPES))})")
    return reader, arch


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader; a ValueError naming the file if it is not a GGUF file or is cut short
    (a partial download: the header or some tensor data would lie past its end)."""
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({size} bytes; truncated or not GGUF: {e})") from e
    short = [t.name for t in reader.tensors if int(t.data_offset) + int(t.n_bytes) > size]
    if short:
        raise ValueError(f"{path} is truncated ({size} bytes): tensor data of {', '.join(short[:4])} lies past its end")
    return reader


def gguf_context_length(path: Path) -> int | None:
    """The context length a GGUF file declares (None if it cannot be read: the load will say why)."""
    try:
        reader = open_gguf(path)
        return int(_get(reader, f"{_require(reader, 'general.architecture')}.context_length", 4096))
    except (ValueError, KeyError, TypeError):
        return None


def gguf_config(reader: GGUFReader, arch: str) -> dict:
    """The HF config.json a GGUF's `{arch}.*` metadata and tensor list describe."""
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file is missing tensor 'token_embd.weight'")
    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF tensor 'rope_freqs.weight' (Llama-3.1 RoPE scaling factors) is not supported")
    hidden = _require(reader, f"{arch}.embedding_length")
    num_heads = _require(reader, f"{arch}.attention.head_count")
    head_dim = _get(reader, f"{arch}.attention.key_length", hidden // num_heads)
    rotary_dim = _get(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"partial RoPE ({arch}.rope.dimension_count={rotary_dim} < head_dim={head_dim}) is not supported")
    hf_name, model_type = GGUF_ARCHITECTURES[arch]
    config = {
        "architectures": [hf_name],
        "model_type": model_type,
        "hidden_act": "silu",
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF dims: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": _require(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _require(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _get(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_get(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _get(reader, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",  # dequantized
    }
    scaling = _get(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _require(reader, f"{arch}.rope.scaling.factor")}
    elif scaling != "none":
        raise ValueError(f"GGUF RoPE scaling {scaling!r} is not supported (only 'linear')")
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors
    if arch == "qwen2":
        config["use_sliding_window"] = False
    bos = _get(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = bos
    eos = _eos_ids(reader)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def gguf_state_dict(reader: GGUFReader, arch: str, hf_config: dict, dtype: torch.dtype = torch.float32
                    ) -> dict[str, torch.Tensor]:
    """All tensors, dequantized (to fp32, then rounded once to `dtype`), in torch dim order, under
    HF names, q/k rows unpermuted. One tensor is dequantized at a time and cast at once, so the
    fp32 copy of the whole model is never held."""
    present = {t.name for t in reader.tensors}
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{part}.weight" for i in range(hf_config["num_hidden_layers"]) for part in LAYER_TENSORS
    ]
    missing = [name for name in required if name not in present]
    if missing:
        raise ValueError(f"GGUF file is missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))

    num_heads, num_kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    state = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # torch order: [out_features, in_features]
        values = dequantize(tensor.data, tensor.tensor_type)  # float32 ndarray, already torch order
        if values.shape != shape:
            raise ValueError(f"GGUF tensor {tensor.name!r} dequantized to {values.shape}, expected {shape}")
        values = np.asarray(values, dtype=np.float32)
        weight = torch.from_numpy(values if values.flags.writeable else values.copy()).to(dtype)  # F32 data: a view of the file
        if arch == "llama" and ".attn_q." in tensor.name:
            weight = unpermute_rows(weight, num_heads)
        elif arch == "llama" and ".attn_k." in tensor.name:
            weight = unpermute_rows(weight, num_kv_heads)
        state[name] = weight
    return state


def hf_tensor_name(name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; ValueError if unknown."""
    base, _, kind = name.rpartition(".")  # kind: "weight" | "bias"
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in minispec's model")


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. w: [num_heads * D, ...] (a weight or a bias).

    Within each head HF pairs row i with row i + D/2 for RoPE; llama.cpp's converter moves them
    next to each other: `w.reshape(H, 2, D/2, ...).swapaxes(1, 2)`, i.e. GGUF row 2j + half holds HF
    row half * D/2 + j. Reading the rows back as (H, D/2, 2) and swapping the last two restores them.
    """
    rows = w.shape[0]
    per_head = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])  # [H, D/2, 2, ...]
    return per_head.transpose(1, 2).reshape(w.shape)  # [H, 2, D/2, ...] -> [H * D, ...]


def gguf_tokenizer(reader: GGUFReader, path: Path) -> Tokenizer:
    """The tokenizer: `tokenizer.json` beside the file if there is one, else built from metadata.
    Special ids and the chat template always come from the GGUF metadata."""
    beside = path.parent / "tokenizer.json"
    tok = HFTokenizer.from_file(str(beside)) if beside.exists() else byte_level_bpe(reader, path)
    return Tokenizer(
        tok,
        eos_token_ids=_eos_ids(reader),
        bos_token_id=_get(reader, "tokenizer.ggml.bos_token_id"),
        chat_template=_get(reader, "tokenizer.chat_template"),
    )


def byte_level_bpe(reader: GGUFReader, path: Path) -> HFTokenizer:
    """A GPT-2-style byte-level BPE tokenizer from tokenizer.ggml.{tokens, merges, token_type}.

    Tokens are stored already spelled in GPT-2's byte alphabet ('Ġt' for ' t'), merges as 'Ġ t'.
    Control tokens (`<|im_start|>`) become special added tokens, user-defined ones plain added
    tokens, so both are matched whole before BPE runs.
    """
    kind = _require(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE); "
            f"put the model's tokenizer.json next to {path}"
        )
    pre = _get(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported ({sorted(PRE_TOKENIZERS)}); "
            f"put the model's tokenizer.json next to {path}"
        )
    tokens = _require(reader, "tokenizer.ggml.tokens")
    token_types = _get(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ")) for m in _get(reader, "tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        repeated = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise ValueError(f"GGUF token list repeats token {repeated!r}; put the model's tokenizer.json next to {path}")

    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == TokenType.CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == TokenType.USER_DEFINED]
    )
    bos = _get(reader, "tokenizer.ggml.bos_token_id")
    if _get(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    return tok


def _get(reader: GGUFReader, key: str, default=None):
    """A metadata value (str, int, float, bool or list), or `default` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: GGUFReader, key: str):
    if key not in reader.fields:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return reader.fields[key].contents()


def _eos_ids(reader: GGUFReader) -> list[int]:
    """llama.cpp stops at every end-of-generation token: eos, end-of-turn, end-of-message."""
    ids = [_get(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999975e-06)."""
    return float(str(np.float32(value)))
