"""Where the defaults live: minispec writes nothing inside its own tree, and a missing default is a
clear error, never a silent fallback.

* the cache directory is $MINISPEC_CACHE, else $XDG_CACHE_HOME/minispec, else ~/.cache/minispec;
* the default target is converted from its GGUF once, into that directory (not into the
  checkout), and found there afterwards without converting again;
* the EAGLE-3 head ships as package data: the wheel built from this tree holds it (and no other
  weights), and a missing head stops the CLI with one line naming what to do.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minispec import cli
from minispec.io import paths
from tiny_gguf import random_hf_state, train_tokenizer, write_gguf

ROOT = Path(__file__).resolve().parents[1]


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "mine"))
    assert paths.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("MINISPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "minispec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "minispec"


def tree_snapshot() -> set[str]:
    return {str(p) for top in ("minispec", "weights", "kernels") for p in (ROOT / top).rglob("*")
            if "__pycache__" not in p.parts}


def test_default_target_converts_once_into_the_cache(monkeypatch, tmp_path, capsys):
    gguf = write_gguf(tmp_path / "tiny.gguf", "llama", random_hf_state("llama", 320, tied=False), train_tokenizer())
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(paths, "smollm2_gguf_path", lambda: gguf)
    before = tree_snapshot()
    target = paths.default_target()
    assert target == tmp_path / "cache" / paths.DEFAULT_TARGET_NAME and (target / "config.json").is_file()
    assert "converting tiny.gguf once" in capsys.readouterr().err
    assert tree_snapshot() == before  # nothing written inside the source tree
    monkeypatch.setattr(paths, "smollm2_gguf_path", lambda: pytest.fail("converted twice"))
    assert paths.default_target() == target


def test_a_missing_default_head_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="default EAGLE-3 head"):
        paths.default_eagle_head()
    monkeypatch.setattr(cli, "default_target", lambda: ROOT)  # exists; the head lookup fails first
    assert cli.main(["generate", "hello"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minispec: error: the default EAGLE-3 head")


def test_the_default_head_is_found_in_the_checkout():
    head = paths.default_eagle_head()
    assert head.resolve() == (ROOT / "weights" / "eagle-smollm2").resolve()


def test_the_wheel_ships_the_eagle_head_and_no_other_weights(tmp_path):
    """What a non-editable `pip install .` installs (one wheel build, about 10 s)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("minispec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    weights = sorted(n for n in names if n.startswith("minispec_weights/"))
    assert weights == ["minispec_weights/eagle-smollm2/README.md", "minispec_weights/eagle-smollm2/config.json",
                       "minispec_weights/eagle-smollm2/model.safetensors"]
    assert "minispec/drafters/base.py" in names and "minispec/kernels/paged_attention.py" in names
    assert not any(n.startswith(("minispec/kernels/aot", "tools/", "training/", "tests/")) for n in names)
