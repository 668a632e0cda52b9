"""One-time conversion of a GGUF file into a Hugging Face checkpoint directory.

Reading a GGUF means parsing ~100k tokenizer strings and dequantizing every tensor (about 10 s
for SmolLM2-135M on two cores); a converted directory loads in a fraction of that through the
ordinary HF path (`load_checkpoint(dir)`). Output: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json. The weights are the GGUF's
dequantized values rounded to `dtype`, so bf16 output is close to, not equal to, the GGUF.

The default target is converted this way once, into the cache directory (paths.py).

CLI: python -m minispec.io.convert FILE.gguf OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..model.config import DTYPES
from .gguf import read_gguf

def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `gguf_path` as an HF checkpoint directory `out_dir` (created if needed) and return it.

    config.json is written last, so a directory that has one holds a complete conversion.
    """
    dtype_name = {v: k for k, v in DTYPES.items()}.get(dtype)
    if dtype_name is None:
        raise ValueError(f"dtype {dtype} is not supported ({sorted(DTYPES)})")
    hf_config, state, tokenizer = read_gguf(gguf_path, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    del state
    tokenizer.tok.save(str(out / "tokenizer.json"))
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_ids
    token = tokenizer.tok.id_to_token
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None if bos is None else token(bos),
            "eos_token": token(eos[0]) if eos else None,
            "chat_template": tokenizer.chat_template,
            "model_max_length": hf_config["max_position_embeddings"],
        },
    )
    generation = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    _write_json(out / "generation_config.json", {k: v for k, v in generation.items() if v not in (None, [])})
    _write_json(out / "config.json", {**hf_config, "torch_dtype": dtype_name})
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a GGUF file into a Hugging Face checkpoint directory.")
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="directory to write (created if needed)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weight dtype (default bfloat16)")
    args = parser.parse_args(argv)
    out = convert_gguf(args.gguf, args.out_dir, DTYPES[args.dtype])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
