"""CPU matmul variants of `nn.Linear`, swapped in after loading (skip this file on a first read).

The model is written on plain `nn.Linear` (y = x W^T + b, W [out, in]). On a CPU the library's
default path is not always the fastest for the few rows of a decode (1) or a verification (k+1),
and which variant helps depends on the CPU, so the loader times the ones that apply on the
model's own weights and swaps every `nn.Linear` for the winner (`use_cpu_fast_paths`), as
`fast/int8.py` swaps in int8 layers, and marks the model with the variant's name
(`cpu_matmul`, model/features.py). All compute the same math:

* `PrepackedLinear` (bf16 on a CPU with native bf16 matmuls; fp32 anywhere): oneDNN's blocked copy
  of W is made once instead of on every call. The copy doubles the memory of the linear weights;
  inference only (with gradients wanted, F.linear runs). oneDNN packs bf16 weights only on CPUs
  with AVX512 (or AVX-NE-CONVERT): elsewhere a bf16 layer can compute in fp32 on an fp32 copy
  (`compute_dtype`), which is what row invariance does there (fast/row_invariant.py).
* `WeightMajorLinear` (fp32): for 1..WEIGHT_MAJOR_ROWS rows, the product with W as the left
  operand, its rows split into one block per thread. Where the default path runs one row on one
  thread and repacks W for a few rows, this uses every core for one row and streams W once for a
  few; where the default path already uses every core well, it is slower, hence the timing.
* `UpcastLinear` (bf16 / fp16 on a CPU without native bf16 matmuls): more than UPCAST_ROWS rows
  are computed in fp32 from an fp32 copy of W made per call, since emulated bf16 GEMMs are slow
  for many rows (a prefill) while the copy costs one pass over W.

Measured figures are in docs/cpu-performance.md.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_caps import cpu_caps
from .matmul_choice import read_cached_choice, write_cached_choice

WEIGHT_MAJOR_ROWS = 16  # fp32 on CPU: linear layers fed 1..16 rows compute W-major
UPCAST_ROWS = 4  # bf16 / fp16 on a CPU without native bf16: linear layers fed more rows compute in fp32
CPU_MATMULS = ("linear", "weight_major", "prepacked", "upcast")  # the entry points, by name
TIMED_BYTES = 32 << 20  # models with less linear weight keep F.linear: their weights sit in the caches, timing misleads
TIMING_SAMPLE_BYTES = 256 << 20  # a bigger model is timed on its first linear weights up to this much
MIN_GAIN = 0.05  # another entry point replaces F.linear only if it is at least this much faster


class WeightMajorLinear(nn.Linear):
    """nn.Linear computing 1..WEIGHT_MAJOR_ROWS rows of a 2-d input by `weight_major`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 1 <= x.shape[0] <= WEIGHT_MAJOR_ROWS:
            return weight_major(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class UpcastLinear(nn.Linear):
    """nn.Linear computing more than UPCAST_ROWS rows of a 2-d input in fp32, rounded once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] > UPCAST_ROWS:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class PrepackedLinear(nn.Linear):
    """nn.Linear through oneDNN's packed copy of W (`packed_weight`), for inference in W's dtype.

    `keep_packed_only()` (the loaders call it for the weights they own) drops W itself, so a
    layer is held once, not twice: W becomes a meta tensor of its shape, and whatever needs it
    dense (F.linear with gradients, another dtype, state_dict, a copy, a move) gets it back from
    the packed copy, exactly (oneDNN's reorder only moves values)."""

    _packed: tuple | None = None  # (the weight it was made from, (its version, data_ptr, dtype), oneDNN's copy)
    compute_dtype: torch.dtype | None = None  # the packed copy's dtype, if not W's (e.g. fp32 for a bf16 W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype and not (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):  # oneDNN's op has no backward
            compute = self.compute_dtype or x.dtype
            bias = None if self.bias is None else self.bias.to(compute)
            y = torch.ops.mkldnn._linear_pointwise(x.to(compute), self.packed_weight(), bias, "none", [], "")
            return y.to(x.dtype)  # (no copy when compute is x's dtype)
        return F.linear(x, self.dense_weight(), self.bias)

    packed_only = property(lambda self: self.weight.is_meta and self._packed is not None)  # W kept by oneDNN only

    def dense_weight(self) -> torch.Tensor:
        """W [out, in]: the parameter, or unpacked from oneDNN's copy once only that is kept."""
        return self._packed[2].to_dense().to(self.weight.dtype) if self.packed_only else self.weight

    def keep_packed_only(self) -> None:
        """Pack W now and drop it (see the class docstring)."""
        packed = self.packed_weight()
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)
        self._packed = (self.weight, None, packed)

    def restore_dense(self) -> None:
        """Undo keep_packed_only: W is a dense parameter again (the packed copy is remade on use)."""
        if self.packed_only:
            self.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
            self._packed = None

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight out (an opaque tensor; remade on first use);
        a layer holding only that is copied with W unpacked."""
        state = dict(super().__getstate__())  # a copy: the live module keeps its packed weight
        if self.packed_only:
            state["_parameters"] = {**state["_parameters"], "weight": nn.Parameter(self.dense_weight(), requires_grad=False)}
        state["_packed"] = None
        return state

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed_only:
            destination[prefix + "weight"] = self.dense_weight()

    def _load_from_state_dict(self, *args, **kwargs):
        self.restore_dense()  # (a meta W would take the values silently: nothing)
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        """Moved or cast (`.to`, `.float()`: W's data is swapped in place): the packed copy is dropped."""
        self.restore_dense()
        self._packed = None
        return super()._apply(fn, recurse)

    def packed_weight(self) -> torch.Tensor:
        """oneDNN's blocked (opaque) copy of W [out, in], made on first use and made again whenever
        W is replaced, moved, cast or changed in place through autograd-visible ops (its version
        counter moves). Writes through `weight.data` bypass the version counter: after one, call
        `set_cpu_matmul` again (a new module, no copy)."""
        if self.packed_only:
            return self._packed[2]
        weight = self.weight
        key = (weight._version, weight.data_ptr(), weight.dtype)
        if self._packed is None or self._packed[0] is not weight or self._packed[1] != key:
            self._packed = (weight, key, pack_weight(weight.to(self.compute_dtype or weight.dtype)))
        return self._packed[2]


VARIANTS = {"linear": nn.Linear, "weight_major": WeightMajorLinear, "prepacked": PrepackedLinear, "upcast": UpcastLinear}


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] -> oneDNN's blocked copy for `torch.ops.mkldnn._linear_pointwise` (any row count).
    A ValueError naming the missing CPU feature where oneDNN cannot pack W's dtype (cpu_caps)."""
    if weight.dtype == torch.bfloat16 and not cpu_caps().onednn_bf16_prepack:
        raise ValueError(f"oneDNN packs {weight.dtype} linear weights only on CPUs with AVX512 (BW, VL, DQ) or "
                         f"AVX-NE-CONVERT; this one is {cpu_caps().describe()}: compute in float32 instead")
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def weight_major(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ weight [out, in]^T (+ bias) computed as weight @ x^T, with weight's rows split
    into P = torch.get_num_threads() blocks that one batched matmul runs in parallel:
    [P, out/P, in] @ [P, in, M] -> [P, out/P, M] -> [M, out]. Falls back to one block when P does
    not divide out (and to F.linear for one row, whose single block is a matrix-vector product)."""
    out_features, in_features = weight.shape
    rows, parts = x.shape[0], torch.get_num_threads()
    if parts > 1 and out_features % parts == 0:
        blocks = weight.view(parts, out_features // parts, in_features)  # [P, out/P, in]
        y = torch.bmm(blocks, x.t().expand(parts, in_features, rows)).view(out_features, rows).t()  # [M, out]
    elif rows > 1:
        y = (weight @ x.t()).t()  # [M, out] (a transposed view of [out, M])
    else:
        return F.linear(x, weight, bias)
    return (y if bias is None else y + bias).contiguous()


def as_variant(linear: nn.Linear, name: str | type) -> nn.Linear:
    """A module of the named variant (or of this nn.Linear subclass) sharing `linear`'s weight and
    bias Parameters (so tied weights stay tied); `linear` itself when it already is one."""
    cls = VARIANTS[name] if isinstance(name, str) else name
    if type(linear) is cls:
        return linear
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.in_features, module.out_features = linear.in_features, linear.out_features
    module.register_parameter("weight", linear.weight)
    module.register_parameter("bias", linear.bias)
    return module.train(linear.training)


def linear_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) for every nn.Linear (any variant) in model."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if isinstance(child, nn.Linear)]


def set_cpu_matmul(model: nn.Module, name: str) -> None:
    """Swap every nn.Linear of `model` for the named variant (CPU_MATMULS), in place."""
    if name not in VARIANTS:
        raise ValueError(f"unknown CPU matmul {name!r}: use one of {', '.join(CPU_MATMULS)}")
    for parent, attr, child in linear_slots(model):
        setattr(parent, attr, as_variant(child, name))
    model.cpu_matmul = name


def native_cpu_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX512-BF16 or AMX, through oneDNN; fast/cpu_caps.py)."""
    return cpu_caps().native_bf16


def cpu_matmul_candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The variants that apply to this dtype on this CPU, F.linear first."""
    if dtype == torch.float32:
        return ("linear", "weight_major", "prepacked")  # oneDNN packs fp32 weights on every x86 CPU
    if not native_cpu_bf16():
        return ("upcast",)  # emulated bf16 / fp16: prefill in fp32 (emulated GEMMs are slow for many rows)
    return ("linear", "prepacked") if dtype == torch.bfloat16 else ("linear",)


def time_cpu_matmuls(model: nn.Module, names: tuple[str, ...], rows: tuple[int, ...] = (1, 5),
                     repeats: int = 3) -> dict[str, float]:
    """Seconds per variant: one pass of x @ W^T over model's linear weights at each row count in
    `rows` (a decode, a k=4 verification), the best of `repeats` passes, summed over `rows`. The
    weights are taken in turn, as a forward streams them (one weight timed in a loop stays in the
    cache and misleads): all of them, or the first TIMING_SAMPLE_BYTES of them in a bigger model
    (far more than any cache holds, and no second copy of a large model while timing). The
    variants take turns within each repeat, so a drift of the machine's speed hits them alike.
    The variant modules are built beside the model (which is not changed) and kept in
    `model._timed_variants`, so that a packed copy made while timing serves the first forward."""
    linears, held = [], 0
    for _, _, m in linear_slots(model):
        if held >= TIMING_SAMPLE_BYTES:
            break
        linears.append(m)
        held += m.weight.numel() * m.weight.element_size()
    variants = {name: [as_variant(m, name) for m in linears] for name in names}
    gen = torch.Generator().manual_seed(0)  # the caller's random streams are left alone
    best = {(name, n): float("inf") for name in names for n in rows}
    with torch.inference_mode():
        inputs = {n: {m.in_features: torch.randn(n, m.in_features, generator=gen).to(m.weight.dtype) for m in linears}
                  for n in rows}  # [n, in] per input width
        for repeat in range(repeats + 1):  # the first pass warms up (and packs)
            for name in names:
                for n in rows:
                    start = time.perf_counter()
                    for m in variants[name]:
                        m(inputs[n][m.in_features])
                    if repeat:
                        best[name, n] = min(best[name, n], time.perf_counter() - start)
    model._timed_variants = {name: {id(m): v for m, v in zip(linears, modules)} for name, modules in variants.items()}
    return {name: sum(best[name, n] for n in rows) for name in names}


def machine_key(model: nn.Module, dtype: torch.dtype) -> str:
    """What the timing depends on: this CPU (and the level it is decided as), torch, the thread count, the
    dtype and the weights' shapes."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    shapes = sorted({tuple(m.weight.shape) for _, _, m in linear_slots(model)})
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    return f"{cpu}|{cpu_caps().level}|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}|{digest}"


def use_cpu_fast_paths(model: nn.Module, dtype: torch.dtype, device: torch.device, prefer: str | None = None,
                       own_weights: bool = False) -> str | None:
    """On CPU, swap every nn.Linear of `model` for the variant that is fastest HERE: `prefer` if it
    applies to this dtype (an EAGLE head passes its target's: one layer's weights are too few to
    time), else $MINISPEC_CPU_MATMUL if it applies (a warning says when it does not), else the
    candidates timed by `time_cpu_matmuls`, where another variant replaces F.linear only if it is
    at least MIN_GAIN faster (so that near-ties do not flip between runs); a model with under
    TIMED_BYTES of linear weight keeps F.linear untimed. A timed choice is kept in the cache
    directory per machine (CPU, torch, threads, dtype, weight shapes), so only the first load on
    a machine pays for the timing. own_weights (a loader's model, whose weights nobody else
    holds): prepacked layers keep only their packed copy. Returns the choice (None off CPU), also
    `model.cpu_matmul`."""
    if device.type != "cpu":
        return None
    env = os.environ.get("MINISPEC_CPU_MATMUL") or None
    if env is not None and env not in CPU_MATMULS:
        raise ValueError(f"MINISPEC_CPU_MATMUL={env!r}: use one of {', '.join(CPU_MATMULS)}")
    candidates = cpu_matmul_candidates(dtype)
    if env is not None and env not in candidates and prefer not in candidates:
        warnings.warn(f"MINISPEC_CPU_MATMUL={env!r} does not apply to {dtype} on this CPU "
                      f"(there: {', '.join(candidates)}); choosing among those", stacklevel=2)
    choice = next((c for c in (prefer, env) if c in candidates), None)
    if choice is None:
        choice = candidates[0]
        weight_bytes = sum({id(m.weight): m.weight.numel() * m.weight.element_size() for _, _, m in linear_slots(model)}.values())
        if len(candidates) > 1 and weight_bytes >= TIMED_BYTES:
            key = machine_key(model, dtype)
            choice = read_cached_choice(key) if read_cached_choice(key) in candidates else None
            if choice is None:
                print("[minispec] timing the CPU matmul variants once for this machine (about a second)", file=sys.stderr)
                seconds = time_cpu_matmuls(model, candidates)
                fastest = min(candidates, key=seconds.get)
                choice = fastest if seconds[fastest] * (1 + MIN_GAIN) < seconds[candidates[0]] else candidates[0]
                write_cached_choice(key, choice)
    timed = model.__dict__.pop("_timed_variants", {}).get(choice, {})
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    slots = linear_slots(model)
    slots.reverse()
    while slots:  # popped one by one: a swapped-out layer (and its dense W, once packed) is freed at once
        parent, attr, child = slots.pop()
        module = timed.pop(id(child), None) or as_variant(child, choice)  # the timer's modules go in as they are
        if own_weights and isinstance(module, PrepackedLinear) and id(module.weight) not in shared:
            module.keep_packed_only()  # one copy of the layer (a tied lm_head keeps the embedding's)
        setattr(parent, attr, module)
        del child, module
    model.cpu_matmul = choice
    return choice
