"""minispec without the `gguf` package (a GPU image that cannot install it).

Invariants: `import minispec` does not import `gguf`; a checkpoint directory loads and generates
(plain and speculative) where `gguf` cannot be imported; reading a .gguf file there fails with an
ImportError that names the package and how to install it, never a bare ModuleNotFoundError from
deep inside the loader. Each case runs in a fresh interpreter with `sys.modules["gguf"] = None`,
which makes every `import gguf` fail as a missing package does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_GGUF = "import sys; sys.modules['gguf'] = None  # as if the package were not installed\n"


def run_without_gguf(code: str, *args: str, cwd: Path) -> str:
    """Run `code` in a fresh interpreter where `import gguf` fails; return its stdout."""
    proc = subprocess.run([sys.executable, "-c", NO_GGUF + code, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_minispec_imports_loads_a_directory_and_generates_without_gguf(tiny_llama, tiny_llama_draft, tmp_path):
    code = """
import sys
import minispec
from minispec import LLM, SamplingParams, load_checkpoint
assert sys.modules['gguf'] is None, 'something replaced the blocked gguf module'
model, tokenizer = load_checkpoint(sys.argv[1], device='cpu')
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
plain = LLM(model=sys.argv[1], kv_cache_gib=0.01, device='cpu').generate(['hello world'], params)[0].token_ids
spec = LLM(model=sys.argv[1], draft_model=sys.argv[2], num_speculative_tokens=2, kv_cache_gib=0.01,
           device='cpu').generate(['hello world'], params)[0].token_ids
assert spec == plain and len(plain) == 6, (spec, plain)
print('generated', len(plain))
"""
    assert "generated 6" in run_without_gguf(code, str(tiny_llama), str(tiny_llama_draft), cwd=tmp_path)


def test_reading_a_gguf_without_the_package_names_it_and_its_install_command(tmp_path):
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF" + bytes(60))  # never parsed: the package is missing first
    code = """
import sys
from minispec import LLM, load_checkpoint
for load in (lambda: load_checkpoint(sys.argv[1], device='cpu'), lambda: LLM(model=sys.argv[1], device='cpu')):
    try:
        load()
    except ImportError as e:
        print(type(e).__name__, e.name, '|', e)
    else:
        raise SystemExit('a .gguf file loaded without the gguf package')
"""
    lines = run_without_gguf(code, str(gguf_file), cwd=tmp_path).splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("ImportError gguf |") and "needs the `gguf` package" in line
        assert "pip install 'gguf>=0.10'" in line and "python -m minispec.io.convert" in line


def test_importing_minispec_and_its_cli_does_not_import_gguf(tmp_path):
    code = "import sys, minispec, minispec.cli, minispec.build, minispec.io.paths\nprint(sys.modules['gguf'])"
    assert run_without_gguf(code, cwd=tmp_path).strip() == "None"
