"""minispec and `transformers` work side by side with PyPI's `kernels` installed, from any directory.

Two packages could answer to `import kernels`: Hugging Face's hub-kernel loader (which
`transformers` 5.25+ requires and imports in its GGUF and hub-kernel paths) and the repository's
top-level `kernels` (a link to minispec/kernels/, where the kernels live). Python puts the working directory (or the script's folder) first on
`sys.path`, so from the repository root a *regular* package `kernels/` there would shadow PyPI's,
and `transformers` would fail (`cannot import name 'CUDAProperties' from 'kernels'`).

So the folder has no `__init__.py` and imports under its own name, `minispec.kernels` (a
subpackage of minispec, its path minispec/kernels/). A folder without `__init__.py` is at most a
namespace-package portion, and Python prefers a regular package anywhere on `sys.path` over it:
`import kernels` is PyPI's everywhere, `import minispec.kernels` is ours everywhere.

Each check runs in a fresh interpreter (import order and `sys.path` are the real ones), once with
the repository root as working directory (where the README's commands run) and once elsewhere
(a user's own script). Each interpreter
  1. generates with minispec on a tiny checkpoint, on both attention backends (the Triton one
     under the interpreter on CPU), and finds minispec's kernels in this repository's `kernels/`;
  2. imports `transformers`' hub-kernels integration and finds PyPI's `kernels` behind it;
  3. loads a tiny GGUF through `transformers`' GGUF path and matches minispec's logits on it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_gguf import random_hf_state, train_tokenizer, write_gguf

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import importlib.util, json, sys
from pathlib import Path
checkpoint, gguf_path = sys.argv[1], Path(sys.argv[2])
r = dict(cwd=str(Path.cwd()))

# 1. minispec: a tiny generation on each backend, with our kernels found where they live.
import torch
import minispec
from minispec import LLM, SamplingParams
import minispec.kernels.paged_attention
r["our_kernels"] = minispec.kernels.paged_attention.__file__
r["generated"] = {}
for backend in ("torch", "triton"):
    llm = LLM(model=checkpoint, backend=backend, dtype=torch.float32)
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    r["generated"][backend] = out[0].token_ids

# 2. transformers: its hub-kernels integration imports PyPI's `kernels`.
import kernels
import transformers
import transformers.integrations.hub_kernels
from transformers.utils import is_kernels_available
r["transformers"] = transformers.__version__
r["kernels_origin"] = kernels.__file__
r["kernels_available"] = is_kernels_available()
r["kernels_api"] = all(hasattr(kernels, n) for n in ("LayerRepository", "Mode", "kernelize", "get_kernel"))

# 3. transformers' GGUF path, next to minispec's loader on the same file.
model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32).eval()
ids = [3, 17, 42, 7, 99]
with torch.no_grad():
    theirs = model(torch.tensor([ids])).logits[0]  # [T, vocab]
    ours_model, _ = minispec.load_checkpoint(gguf_path, dtype=torch.float32, backend="torch")
    ours = ours_model(torch.tensor(ids), minispec.BatchMetadata.for_prompts([len(ids)]))
r["gguf_logit_err"] = float((ours - theirs).abs().max())
print(json.dumps(r))
"""


def run_python(code: str, cwd: Path, *args: str) -> dict:
    """Run `code` in a fresh interpreter in `cwd`; it prints one JSON line last, which is returned."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # sys.path as a user gets it: the working directory first, then site-packages
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"subprocess in {cwd} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    tokenizer = train_tokenizer()
    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=False)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", state, tokenizer)


@pytest.fixture(scope="module", params=["repository root", "another directory"])
def run(request, tiny_llama, tiny_gguf, tmp_path_factory) -> dict:
    cwd = REPO if request.param == "repository root" else tmp_path_factory.mktemp("elsewhere")
    return run_python(SCRIPT, cwd, str(tiny_llama), str(tiny_gguf))


def test_pypi_kernels_is_installed_beside_minispec():
    """The situation users are in: transformers' `kernels` dependency is really installed (the
    test extra names it, so this holds even if transformers stops requiring it)."""
    assert importlib.metadata.version("kernels")
    assert "kernels" not in importlib.metadata.distribution("minispec").read_text("top_level.txt").split()


def test_minispec_generates_with_its_own_kernels(run):
    """`minispec.kernels` is this repository's `kernels/` folder, from any working directory, and
    both backends generate (greedy: the same tokens)."""
    assert Path(run["our_kernels"]).resolve() == (REPO / "kernels" / "paged_attention.py").resolve(), run
    assert len(run["generated"]["torch"]) == 4, run
    assert run["generated"]["triton"] == run["generated"]["torch"], run


def test_transformers_gets_the_pypi_kernels_package(run):
    """`import kernels` is PyPI's hub-kernel loader, never our folder, so transformers' hub-kernels
    integration imports and sees the real package."""
    origin = Path(run["kernels_origin"]).resolve()
    assert REPO not in origin.parents, run
    assert "site-packages" in origin.parts, run
    assert run["kernels_api"] and run["kernels_available"] is True, run


def test_transformers_gguf_path_loads_a_model(run):
    """transformers' GGUF loader (which imports `kernels` on its way) loads the tiny GGUF and
    agrees with minispec's own GGUF loader."""
    assert run["gguf_logit_err"] < 1e-4, run
