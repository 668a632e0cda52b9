"""Int8 weights with dynamic per-row activation scales (minispec/fast/int8.py) and the batch-invariant
attention a quantized model runs with (minispec/invariant_attention.py).

Invariants taught here:
* the CPU kernel path computes the module's stated math (its torch twin) and each output row
  depends on that row alone, bit for bit, whatever else is in the call;
* so does attention with the invariant backend (a row alone == the row in any batch);
* a quantized model's logits for a token do not depend on how the engine batches it;
* loading: int8 from a GGUF (in memory) equals int8 from the same weights in fp32; built models
  are never quantized behind the caller's back; bad input is refused by name.
Greedy identity and the seeded-sampling batch invariance with int8 models run in
test_speculative_greedy.py (its fixture runs every test with fp32 and with int8 weights), and the
statistical exactness test with int8 models in test_speculative_statistical.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minispec.kernels.reference import masked_attention

from minispec import LLM, BatchMetadata, SamplingParams, load_checkpoint, quantize_model
from minispec.model.invariant_attention import invariant_attention, invariant_plan
from torch.nn import Linear
from minispec.fast.int8 import (
    STEP,
    Int8Linear,
    fbgemm_available,
    int8_linear_reference,
    quantize_weight,
)
from minispec.fast.smoothquant import CALIBRATION_TEXT, smooth

pytestmark = pytest.mark.usefixtures("one_thread")
FIXED = settings(derandomize=True, deadline=None, max_examples=30, suppress_health_check=list(HealthCheck))
needs_fbgemm = pytest.mark.skipif(not fbgemm_available(torch.device("cpu")), reason="no fbgemm/x86 quantized engine")


def layer(out_features: int, in_features: int, bias: bool, seed: int = 0) -> tuple[Linear, Int8Linear]:
    torch.manual_seed(seed)
    lin = Linear(in_features, out_features, bias=bias)
    return lin, Int8Linear.from_linear(lin)


def test_weights_are_symmetric_int8_per_output_channel():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -3.0]])
    qweight, scale = quantize_weight(w)
    assert qweight.dtype == torch.int8 and qweight.abs().max() == 127
    torch.testing.assert_close(scale, torch.tensor([1.0 / 127, 1.0, 3.0 / 127]))  # an all-zero row: scale 1
    assert qweight[1].eq(0).all()
    assert (qweight.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-7  # rounding error <= half a step


@needs_fbgemm
@FIXED
@given(rows=st.integers(1, 40), out_in=st.sampled_from([(48, 32), (32, 96), (200, 64)]), bias=st.booleans(),
       spread=st.floats(0.01, 100.0), seed=st.integers(0, 10**6))
def test_kernel_path_computes_the_twins_math(rows, out_in, bias, spread, seed):
    """fbgemm (the CPU path) vs int8_linear_reference: equal up to float rounding of the scales
    (and, rarely, a rounding tie of one activation: at most one grid step of one input)."""
    lin, q = layer(*out_in, bias, seed % 7)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, out_in[1], generator=g) * spread * torch.rand(rows, 1, generator=g)
    got, want = q(x), int8_linear_reference(x, q.qweight, q.scale, q.bias)
    one_step = x.abs().amax(-1, keepdim=True) * STEP * (q.qweight.abs().float() * q.scale[:, None]).amax(-1)  # [rows, out]
    assert ((got - want).abs() <= one_step + 1e-5 * want.abs() + 1e-6).all()
    assert (got - lin(x)).abs().max() < 0.05 * lin(x).abs().max() + 1e-6  # and close to the fp32 layer


@needs_fbgemm
@FIXED
@given(rows=st.integers(2, 40), seed=st.integers(0, 10**6))
def test_each_output_row_depends_on_its_own_input_row_only(rows, seed):
    """Bit for bit: a row computed alone == the same row among others (a per-tensor activation
    scale, which the kernel uses natively, fails this: see the mutant test below)."""
    _, q = layer(96, 64, True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=g) * torch.rand(rows, 1, generator=g) * 50
    together = q(x)
    for i in range(rows):
        assert torch.equal(q(x[i : i + 1])[0], together[i])


@needs_fbgemm
def test_a_per_tensor_activation_scale_would_mix_rows():
    """Power of the test above: the kernel called as PyTorch ships it (one scale per call)
    changes a small row's result when a large row joins it."""
    _, q = layer(96, 64, False)
    q(torch.zeros(1, 64))  # packs
    x = torch.randn(2, 64)
    x[1] *= 1000
    per_tensor = lambda rows: torch.ops.quantized.linear_dynamic(  # noqa: E731
        torch.cat((rows, torch.zeros(len(rows), 2)), -1), q._packed, True)
    assert not torch.equal(per_tensor(x[:1])[0], per_tensor(x)[0])
    assert torch.equal(q(x[:1])[0], q(x)[0])


@FIXED
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4), group=st.sampled_from([1, 3]),
       window=st.sampled_from([None, 5]), seed=st.integers(0, 10**6))
def test_invariant_attention_is_attention_and_is_batch_invariant(lengths, group, window, seed):
    """Each row equals masked softmax attention over its own keys (to fp32 rounding), and each
    sequence's rows are bit for bit the same computed alone or batched with others (from
    differently aligned memory, too)."""
    g = torch.Generator().manual_seed(seed)
    num_kv, D, T = 2, 16, sum(lengths)
    q = torch.randn(T, num_kv * group, D, generator=g)
    k, v = torch.randn(T, num_kv, D, generator=g), torch.randn(T, num_kv, D, generator=g)
    out = invariant_attention(q, k, v, invariant_plan(BatchMetadata.for_prompts(lengths), None, window), 0.3)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        want = masked_attention(q[rows], k[rows], v[rows], torch.arange(n), group=group, sm_scale=0.3, sliding_window=window)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)
        shifted = torch.empty(q[rows].numel() + 1)[1:].view_as(q[rows])  # contiguous, 4 bytes off alignment
        shifted.copy_(q[rows])
        alone = invariant_attention(shifted, k[rows].clone(), v[rows].clone(),
                                    invariant_plan(BatchMetadata.for_prompts([n]), None, window), 0.3)
        assert torch.equal(alone, out[rows])
        start += n


def test_invariant_attention_gives_the_same_bits_in_any_chunking(monkeypatch):
    """Two prompts (41 and 70 rows: groups of up to 32 rows of one prompt share its keys), and a paged
    verification of 5 rows across a bucket edge, batched with a 1-row decode: the output is the
    same bit for bit whether the products run a group at a time or one row at a time."""
    from minispec.model import invariant_attention as ia

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(111, h, 16, generator=g) for h in (6, 2, 2))
    prefill = invariant_plan(BatchMetadata.for_prompts([41, 70]), None, None)
    # (groups, rows) per (L, rows per sequence): L 32 both prompts' first 32 rows; L 64 the first
    # prompt's last 9 rows and the second's next 32 (apart: no group is padded); L 96 the last 6
    assert [tuple(b.visible.shape[:2]) for b in prefill.buckets] == [(2, 32), (1, 9), (1, 32), (1, 6)]
    pool_k, pool_v = torch.randn(12 * 8, 2, 16, generator=g), torch.randn(12 * 8, 2, 16, generator=g)
    paged = BatchMetadata(positions=torch.tensor([60, 61, 62, 63, 64, 20]), query_start_loc=torch.tensor([0, 5, 6]),
                          seq_lens=torch.tensor([65, 21]), max_query_len=5, max_seq_len=65,
                          block_tables=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0, 0, 0, 0]]))
    verify = invariant_plan(paged, 8, None)
    assert [tuple(b.visible.shape[:2]) for b in verify.buckets] == [(1, 1), (1, 4), (1, 1)]  # (groups, rows) per L
    whole = (invariant_attention(q, k, v, prefill, 0.3), invariant_attention(q[:6], pool_k, pool_v, verify, 0.3))
    monkeypatch.setattr(ia, "CHUNK_FLOATS", 1)
    assert torch.equal(invariant_attention(q, k, v, prefill, 0.3), whole[0])
    assert torch.equal(invariant_attention(q[:6], pool_k, pool_v, verify, 0.3), whole[1])
    for row, (b, t) in enumerate([(0, 60), (0, 64), (1, 20)]):  # each row alone: the same bits
        r = [0, 4, 5][row]
        alone = BatchMetadata(positions=torch.tensor([t]), query_start_loc=torch.tensor([0, 1]),
                              seq_lens=torch.tensor([t + 1]), max_query_len=1, max_seq_len=t + 1,
                              block_tables=paged.block_tables[b : b + 1])
        assert torch.equal(invariant_attention(q[r : r + 1], pool_k, pool_v, invariant_plan(alone, 8, None), 0.3), whole[1][r : r + 1])


@pytest.fixture(scope="module")
def int8_target(tiny_llama):
    return load_checkpoint(tiny_llama, dtype="float32", quantization="int8")


def test_quantized_model_switches_to_the_invariant_backend_and_keeps_its_embedding(tiny_llama, int8_target):
    fp32, _ = load_checkpoint(tiny_llama, dtype="float32")
    model, _ = int8_target
    assert model.backend.name == "invariant" and model.quantization == "int8"
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert all(isinstance(m, Int8Linear) for m in (model.lm_head, model.layers[0].mlp.down_proj))
    assert torch.equal(model.embed_tokens.weight, fp32.embed_tokens.weight) and model.dtype == torch.float32
    ids = torch.arange(5, 30)
    meta = lambda: BatchMetadata.for_prompts([len(ids)])  # noqa: E731
    close = torch.nn.functional.cosine_similarity(model(ids, meta()), fp32(ids, meta()), dim=-1)
    assert close.min() > 0.95  # int8 is a different model, but near the fp32 one


def test_a_tokens_logits_do_not_depend_on_how_it_is_batched(int8_target):
    """Prefill of a whole prompt, of a prompt batched with another, and plain decoding through
    the engine (1-row steps): the logits at each position are bitwise equal."""
    model, tok = int8_target
    prompt, other = list(range(3, 40)), list(range(50, 61))
    alone = model(torch.tensor(prompt), BatchMetadata.for_prompts([len(prompt)]))  # [L, V]
    both = model(torch.tensor(other + prompt), BatchMetadata.for_prompts([len(other), len(prompt)]))
    assert torch.equal(both[len(other):], alone)
    llm = LLM((model, tok), kv_cache_gib=0.01, page_size=8, quantization="int8")
    out = llm.generate([prompt[:20]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))[0]
    seq = prompt[:20] + out.token_ids
    full = model(torch.tensor(seq), BatchMetadata.for_prompts([len(seq)])).log_softmax(-1)
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp[token].logprob == full[19 + j, token].item()


def test_gguf_tensors_go_to_int8_in_memory_like_the_fp32_weights(tmp_path):
    from gguf import GGMLQuantizationType
    from tiny_gguf import random_hf_state, train_tokenizer, write_gguf

    tokenizer = train_tokenizer()
    state = random_hf_state("llama", tokenizer.get_vocab_size(), tied=True)
    path = write_gguf(tmp_path / "q8.gguf", "llama", state, tokenizer, GGMLQuantizationType.Q8_0)
    int8, _ = load_checkpoint(path, dtype="float32", quantization="int8")
    fp32, tok = load_checkpoint(path, dtype="float32")
    assert list(tmp_path.iterdir()) == [path]  # nothing written beside it
    reference = quantize_model(fp32, "int8", [tok.encode(CALIBRATION_TEXT)]).state_dict()
    assert set(int8.state_dict()) == set(reference)
    for name, tensor in int8.state_dict().items():  # int8 weights, scales, smoothed norms, embedding
        assert torch.equal(tensor, reference[name]), name


def test_built_models_are_never_quantized_in_place(tiny_llama, int8_target):
    fp32 = load_checkpoint(tiny_llama, dtype="float32")
    with pytest.raises(ValueError, match="already built with full-precision weights"):
        LLM(fp32, quantization="int8", kv_cache_gib=0.01)
    assert isinstance(fp32[0].lm_head, Linear)
    with pytest.raises(ValueError, match="quantization must be None or one of 'int8', got 'int2'"):
        LLM(str(tiny_llama), quantization="int2", kv_cache_gib=0.01)
    LLM(int8_target, quantization="int8", kv_cache_gib=0.01)  # already int8: fine


def test_quantized_target_and_draft_from_paths(tiny_llama, tiny_llama_draft):
    llm = LLM(str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, quantization="int8",
              kv_cache_gib=0.01)
    draft = llm.engine.drafter.runner.model
    assert isinstance(draft.lm_head, Int8Linear) and isinstance(llm.engine.target.model.lm_head, Int8Linear)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(tiny_llama), quantization="int8", kv_cache_gib=0.01)
    assert llm.generate(["w1 w2"], greedy)[0].token_ids == plain.generate(["w1 w2"], greedy)[0].token_ids


def test_smoothing_keeps_the_function_and_tames_an_outlier_channel(tiny_llama):
    """SmoothQuant's folding changes no logit beyond fp32 rounding; with an outlier channel
    planted in the residual stream (as real LLMs have), the int8 model is closer to fp32 with
    smoothing than without."""
    def with_outlier():
        model, tok = load_checkpoint(tiny_llama, dtype="float32")
        with torch.no_grad():
            model.embed_tokens.weight[:, 7] *= 200.0  # one residual channel far larger than the rest
            model.layers[0].input_layernorm.weight[7] = 1.0
        return model, tok
    (plain, tok), (smoothed, _) = with_outlier(), with_outlier()
    calibration = [tok.encode("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")]
    smooth(smoothed, calibration)
    ids = torch.arange(3, 60)
    meta = lambda: BatchMetadata.for_prompts([len(ids)])  # noqa: E731
    reference = plain(ids, meta())
    torch.testing.assert_close(smoothed(ids, meta()), reference, rtol=1e-4, atol=1e-4)
    error = {name: (quantize_model(m)(ids, meta()) - reference).abs().mean().item()
             for name, m in (("plain", plain), ("smoothed", smoothed))}
    assert error["smoothed"] < 0.8 * error["plain"], error


@pytest.fixture
def four_threads():
    """More threads than this machine's cores: torch splits large ops differently, which a
    batch-invariant forward must not notice."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("four_threads")
def test_batch_invariance_holds_with_several_threads(int8_target):
    model, _ = int8_target
    prompt, others = list(range(3, 40)), [list(range(50 + i, 61 + 3 * i)) for i in range(6)]
    alone = model(torch.tensor(prompt), BatchMetadata.for_prompts([len(prompt)]))
    batch = [t for o in others for t in o] + prompt
    both = model(torch.tensor(batch), BatchMetadata.for_prompts([len(o) for o in others] + [len(prompt)]))
    assert torch.equal(both[len(batch) - len(prompt):], alone)


@needs_fbgemm
def test_a_non_finite_row_stays_in_its_row():
    """NaN / inf in one row (one sequence) makes that row's output NaN and leaves the others
    exactly as they are alone (the kernel takes min / max over the whole call)."""
    _, q = layer(32, 64, True)
    x = torch.randn(3, 64)
    for bad in (float("nan"), float("inf")):
        x[1, 5] = bad
        y = q(x)
        assert torch.isnan(y[1]).all() and torch.equal(y[0], q(x[:1])[0]) and torch.equal(y[2], q(x[2:])[0])


def test_quantizing_twice_or_smoothing_without_data_is_refused(tiny_llama, int8_target, tmp_path, tiny_llama_eagle):
    from minispec.io.eagle_checkpoint import load_eagle, save_eagle

    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(int8_target[0])
    fp32, _ = load_checkpoint(tiny_llama, dtype="float32")
    with pytest.raises(ValueError, match="non-empty calibration"):
        smooth(fp32, [[]])
    with pytest.raises(ValueError, match="before quantize_model"):
        smooth(int8_target[0], [[1, 2, 3]])
    head = quantize_model(load_eagle(tiny_llama_eagle, fp32))
    with pytest.raises(ValueError, match="this head is quantized"):
        save_eagle(head, tmp_path / "head")


@pytest.mark.parametrize("arch,dtype,overrides", [("qwen2", "float32", {"tie_word_embeddings": True}),
                                                  ("llama", "bfloat16", {}), ("mistral", "float32", {"sliding_window": 8})])
def test_other_layouts_and_dtypes_quantize_and_stay_exact(checkpoint_factory, arch, dtype, overrides):
    """Qwen2 (q/k/v biases, smoothed with them), a bf16 compute dtype, Mistral's sliding window:
    the int8 model stays near its full-precision self and greedy speculative == greedy plain."""
    path = checkpoint_factory(arch, **overrides)
    full, tok = load_checkpoint(path, dtype=dtype)
    int8 = load_checkpoint(path, dtype=dtype, quantization="int8")
    ids = torch.arange(3, 40)
    meta = lambda: BatchMetadata.for_prompts([len(ids)])  # noqa: E731
    a, b = full(ids, meta()), int8[0](ids, meta())
    assert b.dtype == torch.float32 and int8[0].dtype == getattr(torch, dtype)
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.9
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(int8, quantization="int8", kv_cache_gib=0.01, page_size=8).generate([list(range(3, 20))], greedy)
    spec = LLM(int8, draft_model="ngram", num_speculative_tokens=3, quantization="int8", kv_cache_gib=0.01,
               page_size=8).generate([list(range(3, 20))], greedy)
    assert plain[0].token_ids == spec[0].token_ids


def test_the_twin_path_runs_the_same_model_and_stays_exact(tiny_llama, int8_target, monkeypatch):
    """Where the fbgemm kernel is missing (CUDA, other CPUs) the torch twin runs: same logits up to
    float rounding, and still batch-invariant (greedy speculative == greedy plain)."""
    import minispec.fast.int8

    model, tok = int8_target
    ids = torch.arange(3, 40)
    kernel = model(ids, BatchMetadata.for_prompts([len(ids)]))
    monkeypatch.setattr(minispec.fast.int8, "fbgemm_available", lambda device: False)
    twin_model, _ = load_checkpoint(tiny_llama, dtype="float32", quantization="int8")
    assert twin_model.lm_head._packed is None
    twin = twin_model(ids, BatchMetadata.for_prompts([len(ids)]))
    assert twin_model.lm_head._packed is False  # the twin ran
    torch.testing.assert_close(twin, kernel, rtol=1e-3, atol=1e-3)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(3, 20)), list(range(30, 37))]
    plain = LLM((twin_model, tok), quantization="int8", kv_cache_gib=0.01, page_size=8).generate(prompts, greedy)
    spec = LLM((twin_model, tok), draft_model="ngram", num_speculative_tokens=3, quantization="int8",
               kv_cache_gib=0.01, page_size=8).generate(prompts, greedy)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
