"""Bad checkpoints fail loudly, naming what is wrong; odd but valid ones load to the same model.

The loader's contract: every tensor the config implies is present with the right shape, nothing
else is there, and the files it needs exist; otherwise it raises (ValueError for bad content,
FileNotFoundError for a missing file) with a message that names the tensor, shape or file. A
wrong answer later is never acceptable. Sharded checkpoints and both config.json styles
(transformers 5's `rope_parameters` / `dtype`, older top-level `rope_theta` / `rope_scaling` /
`torch_dtype`) load to exactly the same model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import minispec
from minispec import BatchMetadata, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def ckpt(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny Llama checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def load(path):
    return minispec.load_checkpoint(path, dtype="float32", backend="torch")


def logits(model, n=9):
    ids = torch.arange(n) * 7 % model.cfg.vocab_size  # [n]
    return model(ids, BatchMetadata.for_prompts([n]))


# --- bad content: ValueError naming the problem ------------------------------------------------


def test_unknown_architecture_is_named(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load(ckpt)
    assert "LlamaForCausalLM" in str(err.value)  # ... and says what is supported


def test_missing_tensor_is_named(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.up_proj\.weight"):
        load(ckpt)


def test_missing_lm_head_of_an_untied_model_is_named(ckpt):
    """Only tied checkpoints may omit lm_head.weight."""
    edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load(ckpt)


def test_misshaped_tensor_names_it_and_both_shapes(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].clone()

    edit_tensors(ckpt, shrink)
    with pytest.raises(ValueError) as err:
        load(ckpt)
    msg = str(err.value)
    # k_proj is [num_kv_heads * head_dim, hidden] = [2 * 16, 64]
    assert "layers.0.self_attn.k_proj.weight" in msg and "(16, 64)" in msg and "(32, 64)" in msg, msg


def test_unexpected_tensor_is_named(ckpt):
    """A tensor the config does not explain (here: a bias on a bias-free Llama) means the
    checkpoint and the config disagree; silently ignoring it would compute a different model."""
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.bias"):
        load(ckpt)


def test_unsupported_rope_type_is_rejected(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        load(ckpt)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),  # 4 query heads cannot be grouped by 3
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"dtype": "float8_e4m3fn"}, "float8_e4m3fn"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_or_invalid_config_fields_are_named(ckpt, changes, named):
    edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=named):
        load(ckpt)


def test_unknown_load_dtype_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="float64"):
        minispec.load_checkpoint(tiny_llama, dtype="float64", backend="torch")


# --- missing files: FileNotFoundError naming the file -------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(FileNotFoundError, match="config.json|tokenizer.json|safetensors") as err:
        load(ckpt)
    assert (name if name != "model.safetensors" else "safetensors") in str(err.value)


def test_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load(tmp_path / "nowhere")


# --- sharded checkpoints ------------------------------------------------------------------------


@pytest.fixture
def sharded(tiny_llama, tmp_path) -> Path:
    """tiny_llama re-saved in shards of at most 60 kB, with model.safetensors.index.json."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="60KB")
    shutil.copy(tiny_llama / "tokenizer.json", out)
    return out


def test_sharded_checkpoint_loads_to_the_same_model(tiny_llama, sharded):
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert (sharded / "model.safetensors.index.json").exists() and len(shards) > 2, shards
    whole, _ = load(tiny_llama)
    parts, _ = load(sharded)
    assert torch.equal(logits(whole), logits(parts))


def test_shard_named_in_index_but_missing_is_named(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (sharded / gone).unlink()
    with pytest.raises(FileNotFoundError, match=gone):
        load(sharded)


# --- config styles ------------------------------------------------------------------------------

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "new_style, old_style",
    [
        (  # transformers 5: theta and scaling nested in rope_parameters, "dtype"
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}, "dtype": "bfloat16"},
            # older: top-level rope_theta, rope_scaling with "type" or "rope_type", "torch_dtype"
            {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}, "torch_dtype": "bfloat16"},
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1234.0, "factor": 2.0}, "dtype": "float16"},
            {"rope_theta": 1234.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "torch_dtype": "float16"},
        ),
        (  # no scaling: rope_type "default" in the new style, rope_scaling null in the old
            {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, "dtype": "float32"},
            {"rope_theta": 50000.0, "rope_scaling": None, "torch_dtype": "float32"},
        ),
    ],
)
def test_both_config_styles_parse_to_the_same_model_config(new_style, old_style):
    new = ModelConfig.from_hf({**BASE, **new_style})
    old = ModelConfig.from_hf({**BASE, **old_style})
    assert new == old
    assert new.rope_theta == new_style["rope_parameters"]["rope_theta"]
    assert new.dtype == getattr(torch, new_style["dtype"])
    kind = new_style["rope_parameters"]["rope_type"]
    assert (new.rope_scaling is None) if kind == "default" else (new.rope_scaling["rope_type"] == kind)


def test_an_unsupported_head_dim_is_refused_at_load(checkpoint_factory):
    """head_dim 24 (hidden 96 over 4 heads): refused by name when the model is built; it used to
    load and fail at the first forward, inside the attention check."""
    path = checkpoint_factory("llama", hidden_size=96)
    with pytest.raises(ValueError, match="head_dim 24 is not supported"):
        load(path)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "type": "default", "factor": 2.0},
                                     {"rope_type": "default", "type": "linear", "factor": 2.0},
                                     {"type": "linear", "factor": 2.0}])
def test_rope_type_wins_over_the_old_type_key_as_in_transformers(scaling):
    """A legacy rope_scaling with both keys: transformers reads rope_type (a "default" type key
    used to switch a linear scaling off here)."""
    import transformers

    hf = {**BASE, "rope_theta": 1234.0, "rope_scaling": scaling}
    expected = transformers.LlamaConfig(**hf).rope_parameters["rope_type"]
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.rope_scaling or {"rope_type": "default"})["rope_type"] == expected


def test_config_defaults_and_derived_fields():
    """Absent optional fields get HF's defaults: rope_theta 1e4, no scaling, MHA, fp32."""
    cfg = ModelConfig.from_hf({k: v for k, v in BASE.items() if k != "num_key_value_heads"})
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (
        10000.0,
        None,
        4,
        16,
        torch.float32,
    )
    assert cfg.eos_token_ids == [1]
    assert ModelConfig.from_hf({**BASE, "eos_token_id": [1, 2]}).eos_token_ids == [1, 2]


def test_sliding_window_is_kept_for_mistral_only():
    """Mistral uses its window; Llama has none; Qwen2 carries a value it only uses on request."""
    assert ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 5}).sliding_window == 5
    assert ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"]}).sliding_window == 4096  # transformers' default
    assert ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 5}).sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True})


def test_old_style_config_json_on_disk_loads_to_the_same_logits(checkpoint_factory, tmp_path):
    """Rewrite a transformers-5 config.json (llama3 RoPE) in the old style: same logits, bit for bit."""
    src = checkpoint_factory(
        "llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3, "original_max_position_embeddings": 8}
    )
    old = Path(shutil.copytree(src, tmp_path / "old"))
    config = json.loads((old / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    config["torch_dtype"] = config.pop("dtype", "float32")
    (old / "config.json").write_text(json.dumps(config))
    new_model, _ = load(src)
    old_model, _ = load(old)
    assert new_model.cfg == old_model.cfg
    assert new_model.cfg.rope_scaling is not None
    assert torch.equal(logits(new_model, 20), logits(old_model, 20))


def test_loading_does_not_import_torchs_compiler_stack(tiny_llama):
    """Initialising a model's skeleton on the meta device (an embedding's normal_, RoPE's pow)
    imported torch._dynamo and sympy: about 1 s of every LLM() on a 2-core CPU, 1.63 -> 0.69 s
    for the default model once avoided. Checked in a fresh process."""
    import subprocess
    import sys

    code = ("import sys; from minispec import load_checkpoint; "
            f"load_checkpoint({str(tiny_llama)!r}, dtype='float32', device='cpu'); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
