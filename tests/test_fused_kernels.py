"""The fused layer kernels (kernels/add_rmsnorm.py, rope_write.py, silu_mul.py) agree with their
torch twins, and the twins are the model's own ops.

Without CUDA the kernels run under the Triton interpreter at small, odd sizes. These kernels use
no `tl.dot`, and they round bf16 themselves (kernels/_rounding.py: the interpreter's own cast
truncates), so bf16 is checked here too. Invariants:

* add_rmsnorm: the residual is updated in place to exactly x + residual; y matches the twin to
  an fp32 rounding (the sum of squares runs in another order), so to one ulp in bf16 / fp16
  (and on few elements); without a residual, x is returned as the residual.
* rope_write: bit for bit the twin in every dtype (each product and the sum rounded where torch
  rounds), key heads and values land in their slots, slot -1 writes nothing, page ids beyond
  int32 element offsets work; without a cache it only rotates.
* silu_mul: the twin to an ulp (the kernel's exp is not torch's).
* the twins are exactly today's model ops (RMSNorm in HF's order, apply_rope + write_kv_ref,
  F.silu(gate) * up), so the torch backend computes the same bits as before the fusion.
* bad input raises ValueError naming the problem before any launch.
* a tiny model on the Triton backend gives the torch backend's greedy tokens and close logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minispec.kernels.add_rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm_ref
from minispec.kernels.kv_write import write_kv_ref
from minispec.kernels.rope_write import rope_write, rope_write_ref
from minispec.kernels.silu_mul import silu_mul, silu_mul_ref

from minispec.model.attention import AttentionBackend
from minispec.model.config import ModelConfig
from minispec.fast.fusion import fuse_projections
from minispec.model.llama import Transformer, apply_rope, rope_tables
from minispec.runtime.kv_cache import BlockTable, KVCache
from minispec.runtime.runner import Feed, ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's last place at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    return ((a.float() - b.float()).abs() / (b.float().abs() * eps).clamp_min(torch.finfo(b.dtype).tiny)).max().item()


# --------------------------------------------------------------------------- add_rmsnorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [37, 576])
def test_add_rmsnorm_matches_twin_and_adds_the_residual_in_place(dtype, hidden):
    x, residual, weight = randn(5, hidden, dtype=dtype, seed=1), randn(5, hidden, dtype=dtype, seed=2), \
        randn(hidden, dtype=dtype, seed=3)
    expected_sum = x + residual
    res_kernel, res_twin = residual.clone(), residual.clone()
    y, out_residual = add_rmsnorm(x, res_kernel, weight, 1e-6)
    y_twin, _ = add_rmsnorm_ref(x, res_twin, weight, 1e-6)
    assert out_residual is res_kernel and torch.equal(res_kernel, expected_sum) and torch.equal(res_twin, expected_sum)
    assert y.dtype == dtype and y.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_twin, atol=2e-6, rtol=2e-6)
    else:  # an fp32 sum in another order can move a rounding boundary: one ulp at most
        assert ulps_apart(y, y_twin) <= 1.0 and (y != y_twin).float().mean() < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_without_residual_is_rmsnorm_and_passes_x_on(dtype):
    x, weight = randn(3, 100, dtype=dtype, seed=4), randn(100, dtype=dtype, seed=5)
    y, residual = add_rmsnorm(x, None, weight, 1e-5)
    assert residual is x
    torch.testing.assert_close(y, rmsnorm_ref(x, weight, 1e-5), atol=2e-6, rtol=2e-6)


def test_add_rmsnorm_reads_strided_rows():
    """Rows of a wider buffer (row stride > H): the launcher passes row strides."""
    wide_x, wide_r = randn(4, 96, seed=6), randn(4, 96, seed=7)
    x, residual, weight = wide_x[:, 16:80], wide_r[:, :64], randn(64, seed=8)
    expected_sum = x + residual
    y, _ = add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(wide_r[:, :64], expected_sum)
    torch.testing.assert_close(y, rmsnorm_ref(expected_sum, weight, 1e-6), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_twin_is_the_models_order_of_rounding(dtype):
    """fp32: one F.rms_norm; bf16 / fp16: normalise in fp32, round, then multiply by the weight.
    And the twin's residual add is the model's `x + residual`."""
    x, residual, weight = randn(3, 48, dtype=dtype, seed=9), randn(3, 48, dtype=dtype, seed=10), \
        randn(48, dtype=dtype, seed=11)
    stream = x + residual
    if dtype == torch.float32:
        expected = F.rms_norm(stream, (48,), weight, 1e-6)
    else:
        expected = weight * F.rms_norm(stream.float(), (48,), eps=1e-6).to(dtype)
    y, _ = add_rmsnorm_ref(x, residual.clone(), weight, 1e-6)
    assert torch.equal(y, expected)


ADD_RMSNORM_BAD = {
    "x must be \\[T, H\\]": lambda x, r, w: (x[0], None, w),
    "weight must be \\[H=32\\]": lambda x, r, w: (x, r, w[:16]),
    "weight dtype": lambda x, r, w: (x, r, w.half()),
    "residual .* must match x": lambda x, r, w: (x, r.half(), w),
    "contiguous along H": lambda x, r, w: (x.t().contiguous().t(), r, w),
    "hidden size 20000 is outside": lambda x, r, w: (randn(2, 20000), None, randn(20000)),
    "unsupported dtype": lambda x, r, w: (x.double(), None, w.double()),
}


@pytest.mark.parametrize("message", list(ADD_RMSNORM_BAD))
@pytest.mark.parametrize("fn", [add_rmsnorm, add_rmsnorm_ref], ids=["kernel", "ref"])
def test_add_rmsnorm_rejects_bad_input(fn, message):
    x, residual, weight = randn(2, 32, seed=12), randn(2, 32, seed=13), randn(32, seed=14)
    with pytest.raises(ValueError, match=message):
        fn(*ADD_RMSNORM_BAD[message](x, residual, weight), 1e-6)


# --------------------------------------------------------------------------- rope_write


def rope_case(dtype, num_tokens=5, hq=6, hkv=2, d=16, page_size=4, num_pages=6, seed=0):
    """qk and v as the fused QKV projection's strided views, tables at scattered positions, a
    pool, and slots with one padding token (-1)."""
    qkv = randn(num_tokens, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)  # [T, (Hq + 2 Hkv) D]
    qk = qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d)  # (row stride (Hq + 2 Hkv) D)
    v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
    positions = torch.tensor([3, 17, 0, 9, 40, 2, 5][:num_tokens], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))  # [D/2]
    cos, sin = rope_tables(positions, inv_freq, dtype)  # [T, 1, D] each
    shape = (num_pages, page_size, hkv, d)
    k_cache, v_cache = randn(*shape, dtype=dtype, seed=seed + 1), randn(*shape, dtype=dtype, seed=seed + 2)
    slots = torch.tensor([5, -1, 0, 13, 22, 7, 1][:num_tokens], device=DEVICE)
    return qk, v, cos, sin, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2, 16), (4, 4, 32), (7, 1, 64)], ids=["gqa", "mha", "mqa"])
def test_rope_write_matches_twin_bit_for_bit(dtype, heads):
    hq, hkv, d = heads
    qk, v, cos, sin, k_cache, v_cache, slots = rope_case(dtype, hq=hq, hkv=hkv, d=d)
    k_twin, v_twin = k_cache.clone(), v_cache.clone()
    untouched = k_cache.clone()
    out = rope_write(qk, v, cos, sin, k_cache, v_cache, slots)
    out_twin = rope_write_ref(qk, v, cos, sin, k_twin, v_twin, slots)
    assert out.is_contiguous() and out.shape == qk.shape
    assert torch.equal(out, out_twin)
    assert torch.equal(k_cache, k_twin) and torch.equal(v_cache, v_twin)
    written = {s for s in slots.tolist() if s >= 0}
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 4, slot % 4], out[t, hq:]) and torch.equal(v_cache[slot // 4, slot % 4], v[t])
    for slot in set(range(k_cache.shape[0] * 4)) - written:  # slot -1 and every slot not named: untouched
        assert torch.equal(k_cache[slot // 4, slot % 4], untouched[slot // 4, slot % 4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_twin_is_apply_rope_then_write_kv(dtype):
    """The twin is the model's former ops: apply_rope on the q and k heads, write_kv_ref of k, v."""
    qk, v, cos, sin, k_cache, v_cache, slots = rope_case(dtype)
    k_old, v_old = k_cache.clone(), v_cache.clone()
    rotated = apply_rope(qk, cos, sin)  # [T, Hq + Hkv, D]
    write_kv_ref(rotated[:, 6:], v, k_old, v_old, slots)
    out = rope_write_ref(qk, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(out, rotated) and torch.equal(k_cache, k_old) and torch.equal(v_cache, v_old)


def test_rope_write_without_a_cache_only_rotates():
    qk, v, cos, sin, *_ = rope_case(torch.float32)
    assert torch.equal(rope_write(qk, v, cos, sin, None, None, None), apply_rope(qk, cos, sin))


def test_rope_write_reaches_pages_beyond_int32_element_offsets():
    """page * page_stride past 2^31 elements needs int64 (the pool is torch.empty: only the pages
    written take memory)."""
    page_size, hkv, d = 4, 1, 16
    num_pages = 2**31 // (page_size * hkv * d) + 8
    k_cache = torch.empty(num_pages, page_size, hkv, d, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    qk, v, cos, sin, *_ = rope_case(torch.float16, num_tokens=3, hq=2, hkv=hkv, d=d)
    slots = torch.tensor([(num_pages - 1) * page_size + 3, (num_pages - 5) * page_size, 2], device=DEVICE)
    out = rope_write(qk, v, cos, sin, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // page_size, slot % page_size], out[t, 2:])
        assert torch.equal(v_cache[slot // page_size, slot % page_size], v[t])


ROPE_BAD = {
    "v .* must be \\[T=5, Hkv, D=16\\]": lambda a: dict(v=a["v"][:, :, :8]),
    "head_dim 48 is not supported": lambda a: dict(qk=randn(5, 8, 48), v=randn(5, 2, 48), cos=randn(5, 1, 48),
                                                    sin_signed=randn(5, 1, 48), k_cache=randn(6, 4, 2, 48),
                                                    v_cache=randn(6, 4, 2, 48)),
    "cos and sin_signed must be \\[T=5, 1, D=16\\]": lambda a: dict(cos=a["cos"][:4]),
    "dtypes differ": lambda a: dict(cos=a["cos"].half()),
    "qk must be contiguous in its last": lambda a: dict(qk=a["qk"].transpose(0, 2).contiguous().transpose(0, 2)),
    "together": lambda a: dict(slot_mapping=None),
    "slot_mapping must be int64": lambda a: dict(slot_mapping=a["slot_mapping"].int()),
    "slot_mapping must be contiguous": lambda a: dict(
        slot_mapping=torch.tensor([5, 0, -1, 0, 0, 0, 13, 0, 22, 0], device=DEVICE)[::2]),
    "outside the pool of 24 slots": lambda a: dict(slot_mapping=torch.tensor([5, -1, 0, 24, 1], device=DEVICE)),
    "k_cache and v_cache must both be": lambda a: dict(k_cache=a["k_cache"][:, :, :1]),
}


@pytest.mark.parametrize("message", list(ROPE_BAD))
@pytest.mark.parametrize("fn", [rope_write, rope_write_ref], ids=["kernel", "ref"])
def test_rope_write_rejects_bad_input_before_writing(fn, message):
    qk, v, cos, sin, k_cache, v_cache, slots = rope_case(torch.float32)
    args = dict(qk=qk, v=v, cos=cos, sin_signed=sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    args.update(ROPE_BAD[message](args))
    before = k_cache.clone()
    with pytest.raises(ValueError, match=message):
        fn(**args)
    assert torch.equal(k_cache, before), "a rejected launch wrote to the cache"


# --------------------------------------------------------------------------- silu_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [50, 1100], ids=["one-block", "two-blocks"])
def test_silu_mul_matches_twin(dtype, intermediate):
    gate_up = randn(3, 2 * intermediate, dtype=dtype, seed=20) * 3  # [T, 2I], gates well into silu's curve
    out, twin = silu_mul(gate_up), silu_mul_ref(gate_up)
    assert out.shape == (3, intermediate) and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, twin, atol=1e-6, rtol=1e-6)
    else:
        assert ulps_apart(out, twin) <= 1.0


def test_silu_mul_reads_strided_rows_and_is_the_models_swiglu():
    wide = randn(4, 160, seed=21)  # rows of a wider buffer
    gate_up = wide[:, :128]  # [T, 2I], I = 64
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:], atol=1e-6, rtol=1e-6)
    assert torch.equal(silu_mul_ref(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:])


@pytest.mark.parametrize("fn", [silu_mul, silu_mul_ref], ids=["kernel", "ref"])
def test_silu_mul_rejects_an_odd_width(fn):
    with pytest.raises(ValueError, match="must be even"):
        fn(randn(2, 7))


def test_silu_mul_rejects_bad_input():
    with pytest.raises(ValueError, match="gate_up must be \\[T, 2I\\]"):
        silu_mul(randn(2, 3, 8))
    with pytest.raises(ValueError, match="contiguous along its last"):
        silu_mul(randn(8, 4).t())
    with pytest.raises(ValueError, match="unsupported dtype"):
        silu_mul(randn(2, 8).double())


# --------------------------------------------------------------------------- the model


def test_triton_backend_model_gives_the_torch_backends_greedy_tokens():
    """A tiny fp32 model, prompt then greedy decode through the paged cache, once per backend: the
    same tokens and logits within 1e-4 (the attention kernels and the fused glue together)."""
    cfg = ModelConfig(architecture="qwen2", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=16, qkv_bias=True)
    runs = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        model = Transformer(cfg, backend=AttentionBackend(backend))
        for p in model.parameters():  # (norm weights away from 1, biases away from 0)
            p.data.add_(torch.randn_like(p) * 0.2)
        model = fuse_projections(model).eval()
        cache = KVCache(cfg, num_pages=8, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
        runner, table = ModelRunner(model, cache), BlockTable(4)
        logits = [runner.forward([Feed(table, [3, 14, 15, 92, 65, 35], num_logits=1)])]
        tokens = [int(logits[-1].argmax())]
        for _ in range(5):
            logits.append(runner.forward([Feed(table, tokens[-1:])]))
            tokens.append(int(logits[-1].argmax()))
        runs[backend] = tokens, torch.cat(logits)
    assert runs["triton"][0] == runs["torch"][0]
    torch.testing.assert_close(runs["triton"][1], runs["torch"][1], atol=1e-4, rtol=1e-4)
