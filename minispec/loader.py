"""Load a checkpoint: a Hugging Face directory (config.json, *.safetensors shards, tokenizer.json)
or a single GGUF file (see `gguf_loader.py`).

Every tensor the model needs must be present with the right shape; anything missing, mis-shaped
or unexpected is reported by name instead of surfacing later as a wrong answer.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from .attention import AttentionBackend
from .config import DTYPES, ModelConfig, rope_inv_freq
from .model import Linear, Transformer, fuse_projections, set_cpu_matmul
from .tokenizer import Tokenizer

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
WEIGHT_MAJOR_ROWS = 16  # fp32 on CPU: linear layers fed 1..16 rows compute W-major (model.weight_major)
UPCAST_ROWS = 4  # bf16 / fp16 on a CPU without native bf16: linear layers fed more rows compute in fp32


def native_cpu_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX512-BF16 or AMX, through oneDNN)."""
    flags = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(f is not None and f() for f in flags)


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto'/None: the checkpoint's dtype on CUDA, fp32 on CPU (emulated bf16 is slow on most
    CPUs; where the CPU has native bf16 matmuls, pass dtype="bfloat16", as bench.py does)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)} or 'auto'")
        return dtype
    if dtype in (None, "auto"):
        return cfg.dtype if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir: model.safetensors, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for name in files:
        if not (path / name).exists():
            raise FileNotFoundError(f"shard {name} named in {index.name} is missing from {path}")
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
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


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend | None = None,
    cpu_matmul: str | None = None,
) -> Transformer:
    """Instantiate the model and copy `state` (HF names, optional `model.` prefix) into it.
    cpu_matmul: the Linear entry point to prefer on CPU (`use_cpu_fast_paths`; None: the fastest)."""
    state = {k.removeprefix("model."): v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    with torch.device("meta"):
        model = Transformer(cfg, backend)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)  # some tied checkpoints store a copy anyway
    check_tensors(expected, state, "checkpoint", f"this {cfg.architecture} config")
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict(state, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # fp32 even in a bf16 model
    fuse_projections(model)
    use_cpu_fast_paths(model, dtype, device, prefer=cpu_matmul)
    return model.eval()


CPU_MATMULS = ("linear", "weight_major", "prepacked", "upcast")  # model.Linear's CPU entry points
TIMED_BYTES = 32 << 20  # models with less linear weight keep F.linear: their weights sit in the caches, timing misleads
MIN_GAIN = 0.05  # another entry point replaces F.linear only if it is at least this much faster


def cpu_matmul_candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The Linear entry points that apply to this dtype on this CPU (model.Linear), F.linear first."""
    if dtype == torch.float32:
        return ("linear", "weight_major")
    if not native_cpu_bf16():
        return ("upcast",)  # emulated bf16 / fp16: prefill in fp32 (emulated GEMMs are slow for many rows)
    return ("linear", "prepacked") if dtype == torch.bfloat16 else ("linear",)


def set_cpu_matmul_by_name(model: torch.nn.Module, name: str, keep_packed: bool = False) -> None:
    set_cpu_matmul(model, weight_major_rows=WEIGHT_MAJOR_ROWS if name == "weight_major" else 0,
                   upcast_rows=UPCAST_ROWS if name == "upcast" else 0, prepacked=name == "prepacked",
                   keep_packed=keep_packed)


def time_cpu_matmuls(model: torch.nn.Module, names: tuple[str, ...], rows: tuple[int, ...] = (1, 5),
                     repeats: int = 3) -> dict[str, float]:
    """Seconds per entry point: one pass of x @ W^T over ALL of model's Linear weights at each row
    count in `rows` (a decode, a k=4 verification), the best of `repeats` passes, summed over
    `rows`. All weights in turn, as a forward streams them (one weight timed in a loop stays in
    the cache and misleads); the entry points take turns within each repeat, so a drift of the
    machine's speed hits them alike. Leaves the model set to the last name, packed copies kept."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    gen = torch.Generator().manual_seed(0)  # the caller's random streams are left alone
    best = {(name, n): float("inf") for name in names for n in rows}
    with torch.inference_mode():
        inputs = {n: {m.in_features: torch.randn(n, m.in_features, generator=gen).to(m.weight.dtype) for m in linears}
                  for n in rows}  # [n, in] per input width
        for repeat in range(repeats + 1):  # the first pass warms up (and packs)
            for name in names:
                set_cpu_matmul_by_name(model, name, keep_packed=True)  # packing happens once, in the warm-up
                for n in rows:
                    start = time.perf_counter()
                    for m in linears:
                        m(inputs[n][m.in_features])
                    if repeat:
                        best[name, n] = min(best[name, n], time.perf_counter() - start)
    return {name: sum(best[name, n] for n in rows) for name in names}


def use_cpu_fast_paths(model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                       prefer: str | None = None) -> str | None:
    """On CPU, set every Linear of `model` to the entry point that is fastest HERE (model.Linear):
    `prefer` if it applies to this dtype (`cpu_matmul_candidates`; an EAGLE head passes its
    target's: one layer's weights are too few to time), else $MINISPEC_CPU_MATMUL if it applies
    (a warning says when it does not), else the candidates timed by `time_cpu_matmuls` (~0.5 s for
    SmolLM2-135M), where another entry point replaces F.linear only if it is at least
    MIN_GAIN faster (so that near-ties do not flip between runs); a model with under
    TIMED_BYTES of linear weight keeps F.linear untimed. Returns the choice (None off CPU), also
    kept as `model.cpu_matmul`."""
    if device.type != "cpu":
        return None
    env = os.environ.get("MINISPEC_CPU_MATMUL") or None
    if env is not None and env not in CPU_MATMULS:
        raise ValueError(f"MINISPEC_CPU_MATMUL={env!r}: use one of {', '.join(CPU_MATMULS)}")
    candidates = cpu_matmul_candidates(dtype)
    if env is not None and env not in candidates and prefer not in candidates:
        warnings.warn(f"MINISPEC_CPU_MATMUL={env!r} does not apply to {dtype} on this CPU "
                      f"(there: {', '.join(candidates)}); choosing among those", stacklevel=2)
    choice = next((c for c in (prefer, env) if c in candidates), None)
    if choice is None:
        choice = candidates[0]
        weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}.values()
        if len(candidates) > 1 and sum(w.numel() * w.element_size() for w in weights) >= TIMED_BYTES:
            seconds = time_cpu_matmuls(model, candidates)
            fastest = min(candidates, key=seconds.get)
            if seconds[fastest] * (1 + MIN_GAIN) < seconds[choice]:
                choice = fastest
    set_cpu_matmul_by_name(model, choice, keep_packed=choice == "prepacked")  # the timer's packs serve the first forward
    model.cpu_matmul = choice
    return choice


def load_checkpoint(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    backend: AttentionBackend | str | None = None,
    quantization: str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load (model, tokenizer) from an HF directory or a .gguf file. quantization="int8": every
    linear layer's weight in int8 with dynamic per-row activation scales (quant.py); a GGUF's
    tensors (Q8_0, Q4_1, ...) go from the file to int8 in memory, nothing is written to disk."""
    from .quant import check_quantization, quantize_model
    from .smoothquant import CALIBRATION_TEXT

    check_quantization(quantization)
    path = Path(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not isinstance(backend, AttentionBackend):
        backend = AttentionBackend(backend)
    if path.suffix == ".gguf":
        from .gguf_loader import read_gguf

        hf_config, state, tokenizer = read_gguf(path)
    else:
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {path} is neither a directory nor a .gguf file")
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path} has no config.json")
        hf_config = json.loads(config_file.read_text())
        state = read_safetensors(path)
        tokenizer = Tokenizer.from_dir(path, hf_config)
    cfg = ModelConfig.from_hf(hf_config)
    cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + tokenizer.eos_token_ids))  # every declared end
    # An int8 model's Linears are replaced (quant.Int8Linear): no CPU matmul is worth timing for it.
    model = build_model(cfg, state, resolve_dtype(dtype, cfg, device), device, backend, "linear" if quantization else None)
    del state  # the full-precision tensors: freed before the int8 copies are made
    calibration = [tokenizer.encode(CALIBRATION_TEXT)] if quantization else None
    return quantize_model(model, quantization, calibration), tokenizer
