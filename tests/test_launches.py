"""How many kernels one decoder layer launches on the Triton path, counted without a GPU.

A decode step of a small model on a GPU is bound by launches, not bytes (about 1.3 us each inside
a CUDA graph on an H100), so the Triton backend fuses a layer's elementwise glue
(kernels/add_rmsnorm.py, rope_write.py, silu_mul.py). The count is what would run on a GPU:

* every Triton kernel launch (`run` of Triton's JIT function, or of the interpreter's stand-in on
  CPU), with the torch ops the interpreter itself runs inside a launch not counted;
* every aten op that computes or copies, seen by a TorchDispatchMode. Composite ops (linear,
  rms_norm, reshape, to, matmul, ...) are decomposed first, so a composite counts as the kernels
  it would run; views and other metadata-only ops (`is_view`: view, slice, select, split, t,
  transpose, expand, as_strided, detach, alias, ...) and bare allocations (empty, empty_like,
  new_empty, empty_strided) are not counted.

Counted inside one middle layer's forward (a forward pre-hook and hook switch the counter on and
off), so the embedding, the final norm and the LM head are outside it; that layer receives a
residual and passes one on, like every layer but the first. The paged-attention launcher is made
to split the keys (as `default_num_splits` does on a GPU at small batch), so its combine kernel
is counted too. Invariant: at most 10 per layer for a decode step and for a k + 1 = 4
verification over a paged cache; and the counter sees what it should (the torch backend's layer
counts far more, a planted op counts one more).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minispec.model.attention import AttentionBackend
from minispec.model.config import ModelConfig
from minispec.fast.fusion import fuse_projections
from minispec.model.llama import Transformer
from minispec.runtime.kv_cache import BlockTable, KVCache
from minispec.runtime.runner import Feed, ModelRunner
from minispec.kernels import paged_attention

MAX_LAUNCHES_PER_LAYER = 10
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
               "aten.new_empty.default", "aten.new_empty_strided.default", "aten._unsafe_view.default"}


class LaunchCounter(TorchDispatchMode):
    """Counts Triton launches and compute aten ops while `active` (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.active = False
        self.in_launch = False  # inside a Triton launch: the interpreter's own torch ops are not kernels

    def counting(self) -> bool:
        return self.active and not self.in_launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting():
            with self:  # a composite op counts as the ops it decomposes into
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            if not func.is_view and str(func) not in ALLOCATIONS:
                self.counts[str(func)] += 1
        return func(*args, **kwargs)

    def wrap_launch(self, run):
        """Triton's `run(self, *args, grid, warmup, **kwargs)` wrapped to count one launch."""
        counter = self

        def counted_run(kernel, *args, **kwargs):
            if counter.counting() and not kwargs.get("warmup"):
                counter.counts["triton " + kernel.__name__] += 1
            outer, counter.in_launch = counter.in_launch, True
            try:
                return run(kernel, *args, **kwargs)
            finally:
                counter.in_launch = outer

        return counted_run


@pytest.fixture
def counter(monkeypatch) -> LaunchCounter:
    """A counter hooked into Triton's launches (JIT on a GPU, the interpreter on CPU), with the
    paged-attention launcher splitting the keys 4 ways as it does on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counter = LaunchCounter()
    for cls in (InterpretedFunction, JITFunction):
        monkeypatch.setattr(cls, "run", counter.wrap_launch(cls.run))
    monkeypatch.setattr(paged_attention, "default_num_splits", lambda *args: 4)
    return counter


def tiny_model(backend: str) -> Transformer:
    """Three layers (so layer 1 has a layer on each side), GQA 4/2, fused projections as loaded."""
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    torch.manual_seed(0)
    return fuse_projections(Transformer(cfg, backend=AttentionBackend(backend))).eval()


def per_layer_counts(model: Transformer, counter: LaunchCounter) -> dict[str, collections.Counter]:
    """Counts inside layer 1's forward for a decode step and a 4-token verification, both over a
    paged cache that already holds a 6-token prompt."""
    cache = KVCache(model.cfg, num_pages=8, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    runner, table = ModelRunner(model, cache), BlockTable(4)
    runner.forward([Feed(table, [1, 2, 3, 4, 5, 6])])  # the prompt (not counted)
    layer = model.layers[1]
    hooks = [layer.register_forward_pre_hook(lambda *_: setattr(counter, "active", True)),
             layer.register_forward_hook(lambda *_: setattr(counter, "active", False))]
    counts = {}
    try:
        for step, tokens in (("decode", [7]), ("verify k+1=4", [8, 9, 10, 11])):
            counter.counts = collections.Counter()
            with counter:
                runner.forward([Feed(table, tokens, num_logits=len(tokens))])
            counts[step] = counter.counts
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def described(counts: collections.Counter) -> str:
    return f"{sum(counts.values())} launches: {dict(counts)}"


def test_a_triton_decoder_layer_launches_at_most_10_kernels(counter):
    """Decode and a k + 1 = 4 verification: RMSNorm + add, QKV matmul, RoPE + K/V write, paged
    attention, split combine, O matmul, RMSNorm + add, gate/up matmul, silu * up, down matmul."""
    counts = per_layer_counts(tiny_model("triton"), counter)
    for step, c in counts.items():
        assert sum(c.values()) <= MAX_LAUNCHES_PER_LAYER, f"{step}: {described(c)}"
        assert c["triton _combine_splits_kernel"] == 1, f"{step}: the split combine is not counted: {described(c)}"
        assert c["aten.mm.default"] == 4, f"{step}: expected the 4 projections as matmuls: {described(c)}"


def test_the_counter_sees_every_op_a_layer_runs(counter, monkeypatch):
    """Power: the torch backend's layer (the twins: RMSNorm, RoPE and SwiGLU as separate ops)
    counts far more than 10, and one op planted in the Triton layer counts one more."""
    torch_counts = per_layer_counts(tiny_model("torch"), counter)
    for step, c in torch_counts.items():
        assert sum(c.values()) > 2 * MAX_LAUNCHES_PER_LAYER, f"torch backend, {step}: {described(c)}"

    model = tiny_model("triton")
    before = per_layer_counts(model, counter)
    silu_mul = model.backend.silu_mul
    monkeypatch.setattr(model.backend, "silu_mul", lambda gate_up: silu_mul(gate_up).mul(1.0))  # the planted op
    after = per_layer_counts(model, counter)
    for step in before:
        assert sum(after[step].values()) == sum(before[step].values()) + 1, \
            f"{step}: before {described(before[step])}; with a planted mul {described(after[step])}"
