"""Load a checkpoint: a Hugging Face directory (config.json, *.safetensors shards, tokenizer.json)
or a single GGUF file (see `gguf.py`, imported only when a .gguf file is read: the `gguf` package
is needed for those files alone).

Every tensor the model needs must be present with the right shape; anything missing, mis-shaped
or unexpected is reported by name instead of surfacing later as a wrong answer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..fast.cpu_linear import use_cpu_fast_paths
from ..fast.int4 import check_draft_quantization, quantize_int4_model
from ..fast.int8 import check_quantization, quantize_model
from ..fast.smoothquant import CALIBRATION_TEXT
from ..core import model as core_model
from ..model.attention import AttentionBackend
from ..model.config import DTYPES, ModelConfig
from ..fast.fusion import fuse_projections, fused_state
from ..model.llama import Transformer
from .tokenizer import Tokenizer, read_json_object

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
INTEGER_TENSORS = ("d2t", "t2d")  # an EAGLE-3 head's vocabulary maps (every other tensor is a float weight)


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto'/None: the checkpoint's dtype on CUDA, fp32 on CPU (emulated bf16 is slow on most
    CPUs; where the CPU has native bf16 matmuls, pass dtype="bfloat16", as bench.py does)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)} or 'auto'")
        return dtype
    if dtype in (None, "auto"):  # cfg: the checkpoint's config, or its dtype
        return (cfg if isinstance(cfg, torch.dtype) else cfg.dtype) if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir: model.safetensors, or the shards its index names.

    The tensors are views of the files, read from disk when first touched. Each is opened on its
    own: every view of one `safe_open` keeps the whole file mapped, so the pages a loader had read
    and copied would stay resident until the last tensor was done, doubling a load's peak memory;
    a tensor mapped alone lets go of its pages as soon as the loader has copied it (build_model)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for name in files:
        if not (path / name).exists():
            raise FileNotFoundError(f"shard {name} named in {index.name} is missing from {path}")
        try:
            with safe_open(path / name, framework="pt") as f:
                keys = list(f.keys())
            for key in keys:
                with safe_open(path / name, framework="pt") as f:
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # SafetensorError, OSError, ...: a truncated, empty or foreign file
            raise ValueError(f"{path / name} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    return tensors


def check_tensors(expected: dict[str, torch.Size], state: dict[str, torch.Tensor], what: str, user: str) -> None:
    """Every expected tensor present with its shape and nothing else, or a ValueError naming the
    tensors (what: the checkpoint, e.g. its path; user: what reads it, e.g. "this llama config")."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{what} is missing tensors: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{what} has tensors {user} does not use: {', '.join(unexpected[:8])}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != tuple(shape):
            raise ValueError(f"{what}: tensor {key} has shape {tuple(state[key].shape)}, {user} implies {tuple(shape)}")
        if not state[key].is_floating_point() and key not in INTEGER_TENSORS:
            raise ValueError(f"{what}: tensor {key} holds {state[key].dtype} values, not floating-point weights "
                             "(a quantized export without its scales?); minispec reads float weights or a GGUF file")


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend | None = None,
    cpu_matmul: str | None = None,
    where: str = "checkpoint",
    core: bool = False,
) -> Transformer:
    """Instantiate the model from `state` (HF names, optional `model.` prefix), which is emptied:
    each tensor is taken out, cast (and q/k/v, gate/up fused) and placed in the model before the
    next is read, so a load holds the model once plus one layer's tensors, never two copies.
    cpu_matmul: the nn.Linear variant to prefer on CPU (`use_cpu_fast_paths`; None: the fastest);
    where: the checkpoint's name in errors; core: the core's decoder (minispec/core/model.py) on
    its own backend, its projections unfused and no CPU variant swapped in (`load_core_model`)."""
    for key in [k for k in state if k.startswith("model.") or k.endswith(IGNORED_SUFFIXES)]:
        value = state.pop(key)
        if not key.endswith(IGNORED_SUFFIXES):
            state[key.removeprefix("model.")] = value
    with torch.device("meta"):
        model = core_model.Transformer(cfg, backend) if core else Transformer(cfg, backend)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)  # some tied checkpoints store a copy anyway
    check_tensors(expected, state, where, f"this {cfg.architecture} config")
    if not core:
        fuse_projections(model)  # on the meta device: the fused parameters' shapes
    # Copies, never views of the file: a checkpoint rewritten while the model runs must not change it.
    model.load_state_dict(fused_state(model, state, lambda t: t.to(device=device, dtype=dtype, copy=True)),
                          strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = cfg.rope_inv_freq().to(device)  # fp32 even in a bf16 model
    if not core:
        use_cpu_fast_paths(model, dtype, device, prefer=cpu_matmul, own_weights=True)
    return model.eval()


def peek_checkpoint(path: str | Path) -> tuple[ModelConfig, Tokenizer]:
    """(config, tokenizer) of an HF directory or a .gguf file, no weights read (a GGUF's tensor
    types are checked): what a pair of checkpoints is checked by before either loads."""
    path = Path(path)
    if path.suffix == ".gguf":
        from .gguf import read_gguf_header  # (needs the gguf package: imported only for a .gguf file)

        hf_config, tokenizer = read_gguf_header(path)
    else:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint {path} is neither a directory with config.json nor a .gguf file")
        hf_config = read_json_object(path / "config.json")
        tokenizer = Tokenizer.from_dir(path, hf_config)
    return ModelConfig.from_hf(hf_config), tokenizer


def default_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, else CUDA where there is one, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def read_checkpoint(path: Path, dtype, device: torch.device) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, state dict with HF names, tokenizer) of an HF directory or a .gguf file; the
    config's end tokens are every declared one, the tokenizer's EOS first."""
    if path.suffix == ".gguf":  # dequantized straight to the compute dtype (a GGUF's 'auto' is fp32)
        from .gguf import read_gguf  # (needs the gguf package: imported only for a .gguf file)

        hf_config, state, tokenizer = read_gguf(path, resolve_dtype(dtype, torch.float32, device))
    else:
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {path} is neither a directory nor a .gguf file")
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path} has no config.json")
        hf_config = read_json_object(config_file)
        state = read_safetensors(path)
        tokenizer = Tokenizer.from_dir(path, hf_config)
    cfg = ModelConfig.from_hf(hf_config)
    cfg.eos_token_ids = list(dict.fromkeys(tokenizer.eos_token_ids + cfg.eos_token_ids))
    return cfg, state, tokenizer


def load_core_model(path: str | Path, dtype: str | torch.dtype | None = None,
                    device: str | torch.device | None = None) -> tuple[core_model.Transformer, Tokenizer]:
    """(model, tokenizer) as the core reads them: the core's decoder on plain nn.Linear layers and
    the core's backend (Triton kernels on CUDA, their torch twins elsewhere), none of the
    production rooms (fused projections, CPU matmul variants, quantization)."""
    path, device = Path(path), default_device(device)
    cfg, state, tokenizer = read_checkpoint(path, dtype, device)
    backend = core_model.AttentionBackend()
    return build_model(cfg, state, resolve_dtype(dtype, cfg, device), device, backend, where=f"checkpoint {path}",
                       core=True), tokenizer


def load_checkpoint(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    backend: AttentionBackend | str | None = None,
    quantization: str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load (model, tokenizer) from an HF directory or a .gguf file. quantization="int8": every
    linear layer's weight in int8 with dynamic per-row activation scales (fast/int8.py); "int4":
    int4 weight-only layers, for a draft model (fast/int4.py); a GGUF's tensors (Q8_0, Q4_1, ...)
    go from the file to int8 or int4 in memory, nothing is written to disk.
    A load holds one copy of the weights (build_model), plus one tensor being read."""
    path, device = Path(path), default_device(device)
    if quantization == "int4":
        check_draft_quantization(quantization, device)
    else:
        check_quantization(quantization)
    if not isinstance(backend, AttentionBackend):
        backend = AttentionBackend(backend)
    cfg, state, tokenizer = read_checkpoint(path, dtype, device)
    # An int8 model's Linears are replaced (quant.Int8Linear): no CPU matmul is worth timing for it.
    model = build_model(cfg, state, resolve_dtype(dtype, cfg, device), device, backend, "linear" if quantization else None,
                        f"checkpoint {path}")
    if quantization == "int4":
        return quantize_int4_model(model), tokenizer
    calibration = [tokenizer.encode(CALIBRATION_TEXT)] if quantization else None
    return quantize_model(model, quantization, calibration), tokenizer
