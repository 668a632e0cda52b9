"""Our top-level package `kernels` (Triton kernels) shares its name with an unrelated PyPI package
(Hugging Face's `kernels`, a hub kernel loader) that transformers probes for; transformers must
not mistake ours for theirs.

The probe, in transformers 5.24 `transformers/utils/import_utils.py`:

    is_kernels_available() = find_spec("kernels") is not None
                             and KERNELS_MIN_VERSION (0.18.2) <= version < KERNELS_MAX_VERSION (0.19)

where the version comes from `importlib.metadata.version("kernels")`, else from the distribution
that `packages_distributions()` says ships `kernels` (for us: `minispec`, via its top_level.txt),
else from importing the module and reading `__version__`. If the probe said True,
`transformers.integrations.hub_kernels` would run `from kernels import LayerRepository, ...` at
import time and fail, and `from_pretrained` would route flash attention through the hub.

What keeps it False today: the version found is minispec's own (0.1.0, outside the range), and
our `kernels` defines no `__version__` (the no-metadata fallback gives "N/A", which also fails).
A minispec release numbered 0.18.x would break this; the tests below would catch it.

Each check runs in a fresh interpreter, so the import order is the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd: Path, *args: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last, which is returned."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# One script per fresh interpreter (importing torch + transformers costs seconds, so each
# interpreter answers every question at once).
SCRIPT = """
import importlib.metadata, importlib.util, json, sys
order, path = sys.argv[1], sys.argv[2]
if order == "ours_first":
    import kernels
import torch
import transformers
from transformers.utils import import_utils, is_kernels_available
import transformers.integrations.hub_kernels  # imports from `kernels` at import time iff the probe says yes
found, version = import_utils._is_package_available("kernels", return_version=True)
r = dict(
    transformers=transformers.__version__,
    available=is_kernels_available(),
    found=found,
    version=version,
    origin=importlib.util.find_spec("kernels").origin,
    minispec_version=importlib.metadata.version("minispec"),
)

# 1. ours still imports, with its API
import kernels, minispec
r["ours"] = all(hasattr(kernels, n) for n in ("flash_prefill", "paged_attention", "write_kv"))

# 2. transformers loads and runs a checkpoint, and agrees with minispec
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = torch.tensor([[3, 17, 42, 7, 99]])
with torch.no_grad():
    logits = model(ids).logits[0]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
ours, _ = minispec.load_checkpoint(path, dtype="float32", backend="torch")
mine = ours(ids[0], minispec.BatchMetadata.for_prompts([5]))
r.update(
    attn=model.config._attn_implementation,
    new_tokens=out.shape[1] - 5,
    finite=bool(torch.isfinite(logits).all()),
    err=float((mine - logits).abs().max()),
)

# 3. As if minispec were on sys.path without any dist-info (PYTHONPATH=. in a fresh clone): no
# distribution is known to ship `kernels`, so transformers imports it and reads __version__.
import_utils._package_distribution_mapping = lambda: {}
import_utils.is_kernels_available.cache_clear()
found, version = import_utils._is_package_available("kernels", return_version=True)
r["no_metadata"] = dict(found=found, version=version, available=import_utils.is_kernels_available())
print(json.dumps(r))
"""

RUNS = {  # fresh interpreter: (which is imported first, working directory)
    "transformers first, outside the repo (found via the editable install)": ("transformers_first", "elsewhere"),
    "our kernels first, in the repo root (found on sys.path[0])": ("ours_first", "repo"),
}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tiny_llama, tmp_path_factory) -> dict:
    order, where = RUNS[request.param]
    cwd = REPO if where == "repo" else tmp_path_factory.mktemp("elsewhere")
    return run_python(SCRIPT, cwd, order, str(tiny_llama))


def test_transformers_does_not_take_our_kernels_for_the_hub_package(run):
    """The probe finds our `kernels`, reads minispec's version (0.1.0) and answers False, so
    transformers.integrations.hub_kernels imports without touching our package's API."""
    assert run["transformers"].startswith("5."), run
    assert run["found"] and Path(run["origin"]).resolve() == (REPO / "kernels" / "__init__.py").resolve()
    assert run["version"] == run["minispec_version"], run  # the distribution shipping `kernels` is minispec
    assert run["available"] is False, run
    assert run["ours"]


def test_probe_is_false_without_package_metadata_too(run):
    """Without dist-info the probe imports our kernels, finds no __version__ and answers False."""
    assert run["no_metadata"] == dict(found=True, version="N/A", available=False), run


def test_transformers_loads_and_runs_a_model_with_our_kernels_around(run):
    """transformers still loads a checkpoint, picks its own attention, generates, and agrees
    with minispec on the logits."""
    assert run["attn"] in ("sdpa", "eager"), run
    assert run["new_tokens"] == 4 and run["finite"], run
    assert run["err"] < 1e-4, run
