"""A quantized draft (minispec/fast/int4.py): int4 weight-only layers for a draft model, the
target as loaded.

Invariants taught here:
* quantization is round-to-nearest on a grid of 16 levels per group: each weight moves by at
  most half a step, and the CPU kernel computes the twin's math (dequantize, then a matmul);
* a draft model loads with every layer the kernel can take in int4 (LM head included), the rest
  in int8 weight-only or as they were; the target is never quantized this way;
* the output does not change: one step of the rule with the int4 draft's q emits exactly p, and
  greedy speculative output equals plain greedy output (the law under sampling:
  test_speculative_statistical.py, with a planted bug rejected);
* bad input is refused by name before any weights load.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from minispec import LLM, SamplingParams, load_checkpoint
from minispec.fast.int4 import (
    GROUP,
    Int4Linear,
    Int8WeightOnlyLinear,
    check_draft_quantization,
    cpu_int4_available,
    dequantize_int4,
    int4_linear_reference,
    quantize_int4,
    quantize_int4_model,
)
from minispec.options import EngineOptions
from minispec.core.speculative import accept_probability, residual_distribution

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_int4_available(), reason="this torch build has no CPU int4 kernel")]
FIXED = settings(derandomize=True, deadline=None, max_examples=25, suppress_health_check=list(HealthCheck))


@FIXED
@given(out_in=st.sampled_from([(16, 32), (48, 64), (96, 160)]), spread=st.floats(1e-3, 1e3), seed=st.integers(0, 10**6))
def test_each_weight_moves_by_at_most_half_a_step(out_in, spread, seed):
    """W ~= (q - 8) s + z with q in 0..15 per group of GROUP inputs: |W - deq(W)| <= s / 2."""
    torch.manual_seed(seed)
    w = torch.randn(*out_in) * spread
    q, scales_and_zeros = quantize_int4(w, rows=16)  # several blocks of rows
    assert q.min() >= 0 and q.max() <= 15 and scales_and_zeros.shape == (out_in[1] // GROUP, out_in[0], 2)
    step = scales_and_zeros[..., 0].t().repeat_interleave(GROUP, dim=1)  # [out, in]
    assert ((dequantize_int4(q, scales_and_zeros) - w).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all()
    ends = q.view(out_in[0], -1, GROUP)
    assert (ends.amin(-1) == 0).all() and (ends.amax(-1) == 15).all()  # each group's range is used end to end


@FIXED
@given(rows=st.integers(1, 9), out_in=st.sampled_from([(32, 64), (64, 96)]), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 10**6))
def test_kernel_computes_the_twins_math(rows, out_in, bias, dtype, seed):
    """Int4Linear (torch's CPU int4 kernel) == dequantize-then-F.linear, to bf16's rounding (the
    kernel's dtype, whatever x's), in x's dtype."""
    torch.manual_seed(seed)
    linear = nn.Linear(out_in[1], out_in[0], bias=bias)
    layer = Int4Linear.from_linear(linear, dtype)
    x = torch.randn(rows, out_in[1]).to(dtype)
    q, scales_and_zeros = quantize_int4(linear.weight)
    twin = int4_linear_reference(x, q, scales_and_zeros, None if linear.bias is None else linear.bias.detach())
    y = layer(x)
    assert y.dtype == twin.dtype == dtype
    torch.testing.assert_close(y.float(), twin.float(), rtol=3e-2, atol=3e-2 * twin.abs().max().item())


def test_layers_the_kernel_cannot_take_fall_back_by_shape(tiny_llama):
    """out % 16 or in % GROUP != 0: int8 weight-only (if in % 16 == 0), else the layer stays."""
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 40), nn.Linear(40, 24))
    model.device, model.dtype, model.quantization = torch.device("cpu"), torch.float32, None
    quantize_int4_model(model)
    assert [type(m).__name__ for m in model] == ["Int4Linear", "Int8WeightOnlyLinear", "Linear"]
    x = torch.randn(3, 64)
    torch.testing.assert_close(model[1](torch.randn(3, 32)).shape, torch.Size([3, 40]))
    assert model(x).shape == (3, 24)


def test_a_draft_loads_in_int4_with_its_lm_head(tiny_llama_draft):
    model, _ = load_checkpoint(tiny_llama_draft, dtype="float32", quantization="int4")
    assert model.quantization == "int4"
    assert isinstance(model.lm_head, Int4Linear)  # (320 x 64: the head is the draft's largest matmul)
    assert not any(type(m) is nn.Linear for m in model.modules())
    full, _ = load_checkpoint(tiny_llama_draft, dtype="float32")
    ids = torch.arange(3, 20)
    from minispec import BatchMetadata

    a = model(ids, BatchMetadata.for_prompts([len(ids)])).softmax(-1)
    b = full(ids, BatchMetadata.for_prompts([len(ids)])).softmax(-1)
    assert 0 < (a - b).abs().sum(-1).max() / 2 < 0.5  # another model, close to the one it came from


def test_one_step_with_the_int4_drafts_q_emits_exactly_p(tiny_llama, tiny_llama_draft):
    """P(x) = q(x) a(x) + (1 - sum q a) r(x) == p(x) for p the target's and q the int4 draft's
    next-token distributions at every position of a prompt (fp64, to rounding)."""
    from minispec import BatchMetadata

    target, _ = load_checkpoint(tiny_llama, dtype="float32")
    draft, _ = load_checkpoint(tiny_llama_draft, dtype="float32", quantization="int4")
    ids = torch.arange(5, 40)
    meta = BatchMetadata.for_prompts([len(ids)])
    p = target(ids, meta).double().softmax(-1)  # [T, V]
    q = draft(ids, meta).double().softmax(-1)
    for pi, qi in zip(p, q):
        accepted = qi * accept_probability(pi, qi)
        emitted = accepted + (1 - accepted.sum()) * residual_distribution(pi, qi)
        torch.testing.assert_close(emitted, pi, rtol=0, atol=1e-12)
    assert (p - q).abs().sum(-1).min() > 1e-3  # q really is another distribution


@pytest.mark.parametrize("options", [
    dict(num_speculative_tokens=4),
    dict(num_speculative_tokens=3, draft_confidence_threshold=0.3),
    dict(num_speculative_tokens=3, draft_tree_budget=6, draft_tree_top_k=2),
    dict(num_speculative_tokens=3, prompt_lookup_min=2),
], ids=["chain", "adaptive", "tree", "lookup"])
def test_greedy_output_is_plain_greedy_output(tiny_llama, tiny_llama_draft, options):
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 23)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32", kv_cache_gib=0.01).generate(prompts, params)
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_draft), draft_quantization="int4", dtype="float32",
              kv_cache_gib=0.01, **options)
    assert [r.model.quantization for r, _ in llm.engine.runners] == [None, "int4"]
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.last_metrics.num_drafted > 0


def test_a_draft_from_a_path_takes_a_built_targets_dtype(tiny_llama, tiny_llama_draft):
    """dtype "auto" beside a built bf16 target: the draft loads in bf16 too, not in the CPU's fp32
    default (an fp32 int4 draft was ~25x slower a token on the real pair); an explicit dtype wins."""
    target = load_checkpoint(tiny_llama, dtype="bfloat16")
    llm = LLM(model=target, draft_model=str(tiny_llama_draft), draft_quantization="int4", kv_cache_gib=0.01)
    assert [r.model.dtype for r, _ in llm.engine.runners] == [torch.bfloat16, torch.bfloat16]
    llm = LLM(model=target, draft_model=str(tiny_llama_draft), dtype="float32", kv_cache_gib=0.01)
    assert llm.engine.runners[1][0].model.dtype == torch.float32


def test_vllms_speculative_config_spelling(tiny_llama, tiny_llama_draft):
    o = EngineOptions(model=str(tiny_llama), speculative_config={"model": str(tiny_llama_draft), "quantization": "int4",
                                                                 "num_speculative_tokens": 3})
    assert (o.draft_model, o.draft_quantization, o.num_speculative_tokens) == (str(tiny_llama_draft), "int4", 3)
    with pytest.raises(ValueError, match="draft_quantization=None disagrees|disagrees"):
        EngineOptions(model=str(tiny_llama), draft_quantization="int8",
                      speculative_config={"model": str(tiny_llama_draft), "quantization": "int4"})


@pytest.mark.parametrize("options,message", [
    (dict(quantization="int4"), "is for a draft model only"),
    (dict(draft_quantization="int4"), "draft_quantization='int4' is for a draft model"),
    (dict(draft_model="ngram", draft_quantization="int4"), "draft_quantization='int4' is for a draft model"),
    (dict(draft_quantization="int3", draft_model="DRAFT"), "draft quantization must be None or one of 'int4'"),
    (dict(draft_quantization="int4", draft_model="EAGLE"), "an EAGLE head has neither"),
])
def test_bad_draft_quantization_is_refused_by_name(tiny_llama, tiny_llama_draft, tiny_llama_eagle, options, message):
    paths = {"DRAFT": str(tiny_llama_draft), "EAGLE": str(tiny_llama_eagle)}
    options = {k: paths.get(v, v) for k, v in options.items()}
    with pytest.raises(ValueError, match=message):
        EngineOptions(model=str(tiny_llama), **options)


def test_a_device_without_the_kernel_is_refused():
    with pytest.raises(ValueError, match="runs on CPU .*on cuda leave the draft unquantized"):
        check_draft_quantization("int4", torch.device("cuda"))


def test_a_built_draft_must_carry_the_quantization(tiny_llama, tiny_llama_draft):
    built = load_checkpoint(tiny_llama_draft, dtype="float32")
    with pytest.raises(ValueError, match="passed already built with full-precision weights"):
        EngineOptions(model=str(tiny_llama), draft_model=built, draft_quantization="int4")


def test_a_draft_with_another_tokenizer_is_refused_before_any_weights_load(tiny_llama, tiny_llama_draft, tmp_path,
                                                                           monkeypatch):
    import shutil

    import minispec.build
    from conftest import make_tokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama_draft, other)
    make_tokenizer(other, vocab_size=300)  # another vocabulary, same weights
    monkeypatch.setattr(minispec.build, "load_checkpoint", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ValueError, match=f"draft_model {other}: draft tokenizer differs from the target's"):
        LLM(model=str(tiny_llama), draft_model=str(other), draft_quantization="int4")


def test_a_draft_bigger_than_its_target_is_warned_about(tiny_llama, tiny_llama_draft):
    with pytest.warns(UserWarning, match="is not smaller than the target"):
        LLM(model=str(tiny_llama_draft), draft_model=str(tiny_llama), dtype="float32", kv_cache_gib=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right way round: no warning
        LLM(model=str(tiny_llama), draft_model=str(tiny_llama_draft), dtype="float32", kv_cache_gib=0.01)
