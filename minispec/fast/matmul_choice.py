"""Where the CPU matmul variant timed fastest on a machine is remembered (fast/cpu_linear.py), so
only the first load on a machine pays for the timing: one JSON file in the cache directory,
{machine key: variant name}."""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_file() -> Path:
    from ..io.paths import cache_dir

    return cache_dir() / "cpu_matmul.json"


def read_cached_choice(key: str) -> str | None:
    """The variant timed fastest for this key on an earlier run (None: not timed here yet)."""
    try:
        return json.loads(cache_file().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def write_cached_choice(key: str, choice: str) -> None:
    """Remember the choice for later runs (best effort: an unwritable cache only costs the timing)."""
    path = cache_file()
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        known = known if isinstance(known, dict) else {}
        known[key] = choice
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        tmp.replace(path)
    except (OSError, ValueError):
        pass
