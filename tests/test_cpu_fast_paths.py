"""The engine's fast paths compute what the reference paths compute.

* the CPU variants of `nn.Linear` (fast/cpu_linear.py: a weight-major product for 1..16 rows,
  oneDNN's prepacked weight for bf16, an fp32 upcast for many rows) equal `F.linear`, and whole
  forwards give the same logits either way (fp32: also the same greedy tokens of a speculative
  run); the loader swaps in whichever variant it timed fastest on this CPU;
* the torch attention backend's batched paged attention (fast/attention_plans.py) equals the
  kernel's plain twin, and builds its batch indices (`plan_paged_attention`) once per forward,
  shared across layers, with the same output as building them per layer;
* greedy verification (`greedy_verify`: one argmax, no sampling) equals `rejection_sample` on the
  warped one-hot rows, for random logits with planted ties and random draft runs.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec import LLM, BatchMetadata, SamplingParams, load_checkpoint
from minispec.fast.attention_plans import BATCHED_MAX_QUERY_LEN, paged_attention_cpu, plan_paged_attention
from minispec.fast import cpu_linear
from minispec.fast.cpu_linear import (
    UPCAST_ROWS,
    WEIGHT_MAJOR_ROWS,
    PrepackedLinear,
    UpcastLinear,
    WeightMajorLinear,
    as_variant,
    native_cpu_bf16,
    set_cpu_matmul,
)
from minispec.fast.cpu_caps import cpu_caps
from minispec.io.eagle_checkpoint import load_eagle
from minispec.sampling import warp_probs
from minispec.core.speculative import greedy_verify, rejection_sample
from minispec.kernels.paged_attention import paged_attention_ref
from test_kernels import PagedBatch, head_shapes, seeds, windows


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 24), out=st.sampled_from([80, 81]), bias=st.booleans(), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_weight_major_linear_equals_f_linear(rows, out, bias, threads, seed):
    """Any row count, out_features divisible by the thread count or not, one or two threads."""
    torch.manual_seed(seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_linear(rows, out, bias)
    finally:
        torch.set_num_threads(before)


def check_linear(rows: int, out: int, bias: bool) -> None:
    layer = as_variant(torch.nn.Linear(48, out, bias=bias), "weight_major")
    assert isinstance(layer, WeightMajorLinear) and WEIGHT_MAJOR_ROWS == 16
    x = torch.randn(rows, 48)  # [M, in]
    y = layer(x)  # [M, out]
    assert y.shape == (rows, out) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, rows, 48)  # other ranks take the default path
    torch.testing.assert_close(layer(x3), F.linear(x3, layer.weight, layer.bias))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_upcast_linear_equals_fp32_math_rounded(rows, bias, seed):
    """bf16 layers fed many rows compute in fp32 and round once: exactly F.linear in fp32 on the
    bf16 values, rounded to bf16."""
    torch.manual_seed(seed)
    layer = as_variant(torch.nn.Linear(48, 80, bias=bias).to(torch.bfloat16), "upcast")
    assert isinstance(layer, UpcastLinear)
    x = torch.randn(rows, 48).to(torch.bfloat16)  # [M, in]
    y = layer(x)
    assert y.dtype == torch.bfloat16
    if rows > UPCAST_ROWS:
        b = None if layer.bias is None else layer.bias.float()
        assert torch.equal(y, F.linear(x.float(), layer.weight.float(), b).to(torch.bfloat16))
    else:
        assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


needs_native_bf16 = pytest.mark.skipif(not native_cpu_bf16(), reason="oneDNN packs bf16 weights only on CPUs with native bf16")
# The dtypes oneDNN packs on this CPU kind (fp32 everywhere; bf16 with AVX512 or AVX-NE-CONVERT), so the
# packed-layer tests run on every kind, and under MINISPEC_CPU_ISA=avx2 take the AVX2 branch anywhere.
PACKABLE = [torch.float32] + ([torch.bfloat16] if cpu_caps().onednn_bf16_prepack else [])


def test_loader_keeps_the_fastest_cpu_matmul_it_timed(tiny_llama, monkeypatch):
    """The loader times the entry points that apply to the dtype (fp32: F.linear or weight-major;
    bf16 with native bf16: F.linear or prepacked; emulated bf16: fp32 prefill) and keeps the
    fastest, leaving F.linear only for a clear gain; a tiny model (its weights fit the caches)
    keeps F.linear untimed; $MINISPEC_CPU_MATMUL overrides where it applies, warns where it does
    not, and a name that is none of them is refused."""
    monkeypatch.delenv("MINISPEC_CPU_MATMUL", raising=False)
    timed, seconds = [], {"linear": 2.0, "weight_major": 1.0, "prepacked": 2.5}

    def fake_time(model, names, **_):
        timed.append(names)
        return {name: seconds[name] for name in names}

    monkeypatch.setattr(cpu_linear, "time_cpu_matmuls", fake_time)
    monkeypatch.setattr(cpu_linear, "read_cached_choice", lambda key: None)  # every load times (see the cache test)
    plan = lambda model: {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}  # noqa: E731
    fp32, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    assert fp32.cpu_matmul == "linear" and plan(fp32) == {torch.nn.Linear} and timed == []  # too small to time
    monkeypatch.setattr(cpu_linear, "TIMED_BYTES", 0)
    fp32, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    assert timed == [("linear", "weight_major", "prepacked")] and fp32.cpu_matmul == "weight_major"
    assert plan(fp32) == {WeightMajorLinear}
    assert fp32.lm_head.weight is fp32.embed_tokens.weight or not fp32.cfg.tie_word_embeddings  # tying survives the swap
    seconds["weight_major"] = 1.99  # faster, but by less than MIN_GAIN: F.linear stays
    assert load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")[0].cpu_matmul == "linear"
    bf16, _ = load_checkpoint(tiny_llama, dtype=torch.bfloat16, device="cpu")
    assert plan(bf16) == ({PrepackedLinear} if native_cpu_bf16() else {UpcastLinear})
    monkeypatch.setenv("MINISPEC_CPU_MATMUL", "weight_major")
    fp32, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    assert fp32.cpu_matmul == "weight_major" and plan(fp32) == {WeightMajorLinear}
    with pytest.warns(UserWarning, match="does not apply to torch.bfloat16"):
        load_checkpoint(tiny_llama, dtype=torch.bfloat16, device="cpu")
    monkeypatch.setenv("MINISPEC_CPU_MATMUL", "weight-major")
    with pytest.raises(ValueError, match="MINISPEC_CPU_MATMUL='weight-major'"):
        load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")


def test_the_timed_choice_is_cached_per_machine_and_dtype(tiny_llama, monkeypatch, tmp_path):
    """The first load on a machine times the candidates; later loads (other processes too: the
    choice is in the cache directory) reuse its choice without timing, per dtype."""
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("MINISPEC_CPU_MATMUL", raising=False)
    monkeypatch.setattr(cpu_linear, "TIMED_BYTES", 0)
    timed = []
    monkeypatch.setattr(cpu_linear, "time_cpu_matmuls",
                        lambda model, names, **_: timed.append(names) or {"linear": 2.0, "weight_major": 1.0, "prepacked": 1.5})
    first = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")[0]
    again = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")[0]
    assert first.cpu_matmul == again.cpu_matmul == "weight_major" and timed == [("linear", "weight_major", "prepacked")]
    key = cpu_linear.machine_key(again, torch.float32)
    assert json.loads((tmp_path / "cpu_matmul.json").read_text()) == {key: "weight_major"}
    assert "torch.float32" in key and torch.__version__ in key
    if native_cpu_bf16():  # another dtype is timed on its own
        load_checkpoint(tiny_llama, dtype=torch.bfloat16, device="cpu")
        assert timed[-1] == ("linear", "prepacked")


def test_the_timer_times_each_candidate_and_leaves_random_streams_alone(tiny_llama):
    model, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    torch.manual_seed(7)
    seconds = cpu_linear.time_cpu_matmuls(model, ("linear", "weight_major"), repeats=1)
    assert set(seconds) == {"linear", "weight_major"} and all(0 < t < 10 for t in seconds.values())
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.parametrize("dtype", PACKABLE)
def test_the_timer_packs_each_weight_once(tiny_llama, monkeypatch, dtype):
    """Timing F.linear and prepacked in turns must not time the packing: each weight is packed
    once, in the warm-up pass, however many repeats follow."""
    model, _ = load_checkpoint(tiny_llama, dtype=dtype, device="cpu")
    packed, pack = [], cpu_linear.pack_weight
    monkeypatch.setattr(cpu_linear, "pack_weight", lambda w: packed.append(w) or pack(w))
    cpu_linear.time_cpu_matmuls(model, ("linear", "prepacked"), repeats=3)
    assert len(packed) == len({id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)})


def test_eagle_head_takes_its_targets_cpu_matmul(tiny_llama, tiny_llama_eagle, monkeypatch):
    monkeypatch.setenv("MINISPEC_CPU_MATMUL", "weight_major")
    target, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    monkeypatch.delenv("MINISPEC_CPU_MATMUL")
    head = load_eagle(tiny_llama_eagle, target)
    assert target.cpu_matmul == head.cpu_matmul == "weight_major"
    assert all(isinstance(m, WeightMajorLinear) for m in head.modules() if isinstance(m, torch.nn.Linear))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), bias=st.booleans(), seed=st.integers(0, 2**16), compute=st.sampled_from(PACKABLE))
def test_prepacked_linear_equals_f_linear(rows, bias, seed, compute):
    """oneDNN's packed copy of W gives F.linear's result (to bf16 rounding: another kernel may add
    in another order), for 2-d and 3-d inputs and a non-contiguous one; a weight changed in place,
    replaced or cast is packed again, never used stale; with gradients wanted F.linear runs. On a
    CPU kind that cannot pack bf16, the bf16 layer computes on an fp32 packed copy (compute)."""
    torch.manual_seed(seed)
    layer = as_variant(torch.nn.Linear(48, 80, bias=bias).to(torch.bfloat16), "prepacked")
    layer.compute_dtype = compute

    def check(x):
        with torch.inference_mode():
            y = layer(x)
        assert layer._packed is not None and layer._packed[0] is layer.weight  # the packed path ran
        torch.testing.assert_close(y.float(), F.linear(x, layer.weight, layer.bias).float(), atol=0.05, rtol=0.02)

    for x in (torch.randn(rows, 48), torch.randn(2, rows, 48), torch.randn(48, rows).t()):
        check(x.to(torch.bfloat16))
    x = torch.randn(rows, 48).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(-1)
    check(x)
    layer.weight = torch.nn.Parameter(torch.randn(80, 48).to(torch.bfloat16))
    check(x)
    layer.float().bfloat16()  # cast and back: the data is swapped inside the same Parameter
    assert layer._packed is None
    check(x)
    copied = copy.deepcopy(layer)  # the opaque copy is left out, then remade
    assert copied._packed is None and layer._packed is not None
    with torch.inference_mode():
        assert torch.equal(copied(x), layer(x))
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()  # grad mode: F.linear, so gradients reach x and W
    assert xg.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("compute", PACKABLE)
def test_a_layer_holding_only_its_packed_copy_is_the_same_layer(compute):
    """keep_packed_only drops W (held once, not twice) and changes nothing a user can see: the
    output, W unpacked exactly (F.linear with gradients, state_dict, copies), a cast, a reload.
    Also for a bf16 layer packed in fp32 (a CPU kind without bf16 packing): bf16 -> fp32 -> bf16
    is exact."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 80).to(torch.bfloat16)
    weight = dense.weight.detach().clone()
    layer = as_variant(dense, "prepacked")
    layer.compute_dtype = compute
    x = torch.randn(3, 48).to(torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
    layer.keep_packed_only()
    assert layer.packed_only and layer.weight.is_meta and layer.weight.shape == (80, 48)
    with torch.inference_mode():
        assert torch.equal(layer(x), before)
    assert torch.equal(layer.dense_weight(), weight)
    assert torch.equal(layer.state_dict()["weight"], weight)
    copied = copy.deepcopy(layer)
    with torch.inference_mode():
        assert torch.equal(copied(x), before)
    assert torch.equal(layer(x.clone().requires_grad_()), F.linear(x, weight, layer.bias))  # grad mode: F.linear
    fresh = as_variant(torch.nn.Linear(48, 80).to(torch.bfloat16), "prepacked")
    fresh.compute_dtype = compute
    fresh.keep_packed_only()
    fresh.load_state_dict(layer.state_dict())  # a meta W would take the values silently: nothing
    assert torch.equal(fresh.weight, weight) and not fresh.packed_only
    layer.float()
    assert not layer.packed_only and torch.equal(layer.weight, weight.float())


@pytest.mark.parametrize("dtype", PACKABLE)
def test_a_loaded_prepacked_model_holds_each_weight_once(tiny_llama, monkeypatch, dtype):
    """The loader keeps only the packed copy of each linear weight it owns; a tied lm_head keeps
    the embedding's W (the embedding needs it). Logits and the checkpoint's tensors are unchanged."""
    from minispec.io.checkpoint import read_safetensors
    from minispec.fast.fusion import checkpoint_state_dict

    monkeypatch.setenv("MINISPEC_CPU_MATMUL", "prepacked")
    model, _ = load_checkpoint(tiny_llama, dtype=dtype, device="cpu")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, PrepackedLinear) and m.packed_only for m in linears)
    saved = {k.removeprefix("model."): v for k, v in read_safetensors(tiny_llama).items()}
    state = checkpoint_state_dict(model)
    assert all(torch.equal(state[k], saved[k].to(dtype)) for k in saved)
    monkeypatch.setenv("MINISPEC_CPU_MATMUL", "linear")
    plain, _ = load_checkpoint(tiny_llama, dtype=dtype, device="cpu")
    ids = torch.arange(5, 30)
    torch.testing.assert_close(model(ids, BatchMetadata.for_prompts([len(ids)])),
                               plain(ids, BatchMetadata.for_prompts([len(ids)])), atol=0.05, rtol=0.02)


def test_verification_logits_do_not_depend_on_the_linear_path(tiny_llama):
    """A 5-token verification over a cached prompt: logits with the weight-major product match
    the F.linear ones to fp32 rounding, and so do the greedy tokens of a speculative run."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs, logits = [], []
    for variant in ("weight_major", "linear"):
        model, tok = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
        set_cpu_matmul(model, variant)
        llm = LLM(model=(model, tok), draft_model="ngram", num_speculative_tokens=4, kv_cache_gib=0.01)
        outputs.append(llm.generate(["the quick brown fox jumps"], params)[0].token_ids)
        ids = torch.tensor(tok.encode("hello world, this is a test of"))

        logits.append(model(ids, BatchMetadata.for_prompts([len(ids)]))[-5:])  # [5, V]
    assert outputs[0] == outputs[1]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@needs_native_bf16
def test_bf16_logits_do_not_depend_on_prepacking(tiny_llama):
    """A whole bf16 forward, a prompt and then one token over its cache, with oneDNN's packed
    weights and with F.linear: the same logits to bf16 rounding."""
    ids = torch.arange(5, 30)
    logits = []
    for prepacked in (True, False):
        model, _ = load_checkpoint(tiny_llama, dtype=torch.bfloat16, device="cpu")
        set_cpu_matmul(model, "prepacked" if prepacked else "linear")
        logits.append(model(ids, BatchMetadata.for_prompts([len(ids)])))  # [T, V] fp32
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(getattr(m, "_packed", None) is not None for m in linears) == prepacked
    torch.testing.assert_close(logits[0], logits[1], atol=0.05, rtol=0.02)


def test_attention_indices_are_built_once_per_forward(tiny_llama, monkeypatch):
    """Two layers, one decode forward: the CPU attention plan is built once, and the output equals
    a run that builds it in every layer."""
    model, tok = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    calls = []
    original = model.backend._plan

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(model.backend, "_plan", counting)
    llm = LLM(model=(model, tok), kv_cache_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    shared = llm.generate(["hello world"], params)[0].token_ids
    assert len(calls) == 2  # two decode forwards (the prompt's prefill needs none), not 2 x num_layers
    assert model.cfg.num_layers == 2

    def per_layer(backend, q, k, v, kv_cache, meta, sm_scale, sliding_window, call=type(model.backend).__call__):
        meta.attention_plan = None  # forget the plan: every layer rebuilds it
        return call(backend, q, k, v, kv_cache, meta, sm_scale, sliding_window)

    monkeypatch.setattr(type(model.backend), "__call__", per_layer)  # (the backend also runs the layer's glue)
    assert LLM(model=(model, tok), kv_cache_gib=0.01).generate(["hello world"], params)[0].token_ids == shared
    assert len(calls) == 2 + 2 * model.cfg.num_layers


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seq_lens=st.lists(st.integers(1, 40), min_size=1, max_size=5), data=st.data(),
       page_size=st.sampled_from([1, 4, 16]), heads=head_shapes, window=windows, seed=seeds)
def test_cpu_attention_plan_equals_the_twin(seq_lens, data, page_size, heads, window, seed):
    """The torch backend's batched paged attention (fast/attention_plans.py: sequences with few new
    tokens batched together, even when mixed with sequences without new tokens or with whole
    prompts, which loop) gives the kernel twin's per-sequence output, over NaN-filled unused pages."""
    q_lens = [data.draw(st.one_of(st.integers(0, min(n, BATCHED_MAX_QUERY_LEN)), st.just(n))) for n in seq_lens]
    q_lens[0] = max(q_lens[0], 1)
    (num_kv_heads, group, head_dim) = heads
    batch = PagedBatch(seq_lens, q_lens, page_size=page_size, num_q_heads=num_kv_heads * group,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32, seed=seed)
    batched = paged_attention_cpu(*batch.args(), sm_scale=0.3, sliding_window=window)
    looped = paged_attention_ref(*batch.args(), sm_scale=0.3, sliding_window=window)
    assert not batched.isnan().any()
    # Two fp32 reduction orders: CI met a 1.4e-6 difference (seq_lens [1, 1, 1, 7, 1], seed 124).
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=1e-5)


def test_a_lone_decode_row_takes_no_mask_and_a_window_or_a_ragged_batch_do():
    """The CPU plan's decode batch skips the mask when it hides no key (one sequence, no window):
    right then (float64 reference), and the mask is still there when a window or a shorter
    sequence beside a longer one hides keys (a plan that dropped it would attend to them)."""
    for seq_lens, window, masked in (([37], None, False), ([37], 8, True), ([37, 12], None, True)):
        batch = PagedBatch(seq_lens, [1] * len(seq_lens), page_size=8, num_q_heads=4, num_kv_heads=2,
                           head_dim=16, dtype=torch.float32, seed=5)
        plan = plan_paged_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 8, window)
        assert (plan.short.hidden is not None) == masked
        out = paged_attention_cpu(*batch.args(), sm_scale=0.3, sliding_window=window, plan=plan)
        torch.testing.assert_close(out.cpu().double(), batch.naive(sm_scale=0.3, sliding_window=window),
                                   atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_greedy_verify_equals_rejection_sample_on_one_hot_rows(data):
    vocab = data.draw(st.integers(2, 6))
    draft_lists = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=4), min_size=1, max_size=4))
    rows = sum(len(d) + 1 for d in draft_lists)
    # integer-valued logits: ties are common, and both rules must break them the same way
    logits = torch.tensor(data.draw(st.lists(st.lists(st.integers(-2, 2), min_size=vocab, max_size=vocab),
                                             min_size=rows, max_size=rows)), dtype=torch.float32)
    # drafts that often follow the argmax, so long accepted runs occur
    best, row = logits.argmax(-1).tolist(), 0
    for d in draft_lists:
        for i in range(len(d)):
            if data.draw(st.booleans()):
                d[i] = best[row + i]
        row += len(d) + 1
    tokens, num_accepted = greedy_verify(logits, draft_lists)

    greedy = SamplingParams(temperature=0)
    probs = warp_probs(logits, [greedy] * rows)  # one-hot rows [rows, V]
    B, K = len(draft_lists), max(len(d) for d in draft_lists)
    target = torch.zeros(B, K + 1, vocab)
    draft = torch.zeros(B, K + 1, vocab)
    draft_tokens = torch.zeros(B, K, dtype=torch.int64)
    row = 0
    for b, d in enumerate(draft_lists):
        target[b, : len(d) + 1] = probs[row : row + len(d) + 1]
        for i, t in enumerate(d):
            draft[b, i, t] = 1.0
            draft_tokens[b, i] = t
        row += len(d) + 1
    accept_u, token_u = torch.rand(B, K, dtype=torch.float64), torch.rand(B, K + 1, dtype=torch.float64)  # (one-hot: unused)
    expected, expected_accepted = rejection_sample(draft_tokens, torch.tensor([len(d) for d in draft_lists]),
                                                   draft, target, accept_u, token_u)
    assert num_accepted == expected_accepted.tolist()
    assert tokens == [expected[b, : n + 1].tolist() for b, n in enumerate(num_accepted)]


# --- CPU kinds (fast/cpu_caps.py) ------------------------------------------------------------------


def test_the_cpu_can_be_decided_as_a_lesser_kind_never_a_greater(monkeypatch):
    """MINISPEC_CPU_ISA caps what every fast path sees: at avx2 no AVX512, no native bf16 and no
    bf16 packing, whatever the hardware; a level above the hardware's, or an unknown one, is a
    ValueError naming the variable (never a crash later inside oneDNN)."""
    from minispec.fast.cpu_caps import ISA_ENV, LEVELS, hardware_caps

    monkeypatch.setenv(ISA_ENV, "avx2")
    caps = cpu_caps()
    assert caps.level == "avx2" and not (caps.avx512 or caps.native_bf16 or caps.onednn_bf16_prepack)
    assert not native_cpu_bf16() and cpu_linear.cpu_matmul_candidates(torch.bfloat16) == ("upcast",)
    assert "MINISPEC_CPU_ISA=avx2" in caps.describe()
    above = LEVELS[LEVELS.index(hardware_caps().level) + 1:] if hardware_caps().level in LEVELS else LEVELS
    for level in list(above) + ["avx1024"]:
        monkeypatch.setenv(ISA_ENV, level)
        with pytest.raises(ValueError, match=ISA_ENV):
            cpu_caps()
    monkeypatch.delenv(ISA_ENV)
    assert cpu_caps() == hardware_caps() and cpu_caps().capped is None


def test_packing_bf16_where_onednn_cannot_is_a_named_error(monkeypatch):
    """On a CPU kind without bf16 packing (AVX2 only, here decided so on any CPU) packing a bf16
    weight is a ValueError naming the missing feature, not oneDNN's crash; fp32 packs."""
    monkeypatch.setenv("MINISPEC_CPU_ISA", "avx2")
    with pytest.raises(ValueError, match="AVX512 .BW, VL, DQ. or AVX-NE-CONVERT"):
        cpu_linear.pack_weight(torch.randn(16, 32).to(torch.bfloat16))
    cpu_linear.pack_weight(torch.randn(16, 32))
