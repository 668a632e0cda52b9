"""The EAGLE-3 feature drafter: checkpoint layout, the catch-up pass, and q over the full vocabulary.

Greedy identity, batch invariance, preemption and the full-pipeline statistical test run this
drafter too (test_speculative_greedy.py, test_engine.py, test_speculative_statistical.py); this
file checks what is particular to it:
* the catch-up: after any accept/reject history, every proposal (the first token and the chained
  ones) is what a fresh drafter computes from the accepted prefix alone, with cache-free dense
  forwards; a drafter that skips the catch-up fails the same check (power);
* the official checkpoint layout round-trips, and a checkpoint that does not fit its target is
  refused with an error naming both sides;
* the target returns the requested layers' hidden states only when asked (and they are HF's).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import minispec.io.eagle_checkpoint
from minispec import LLM, BatchMetadata, SamplingParams, load_checkpoint
from minispec.drafters.eagle import EagleDrafter
from minispec.io.eagle_checkpoint import is_eagle_checkpoint, load_eagle, save_eagle
from minispec.model.eagle import init_eagle
from minispec.sampling import warp_probs
from proposals import recording_proposals

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a 2nd OpenMP thread only contends

OFFICIAL_TENSORS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_checkpoint(tiny_llama, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def eagle(target, tiny_llama_eagle):
    return load_eagle(tiny_llama_eagle, target[0])


# --- the reference: a fresh drafter, cache-free ------------------------------------------------


@torch.inference_mode()
def fresh_proposals(target, eagle, tokens: list[int], drafts: list[int], params: SamplingParams) -> torch.Tensor:
    """q_1..q_n [n, V] for drafting after `tokens` (x_0..x_{m-1}), computed from scratch: one
    cache-free target forward for the features h_0..h_{m-2}, then for each draft position a
    cache-free draft forward over every position so far, positions 0..m-2 fed (fc(h_p), x_{p+1})
    and chained position m-2+j fed (g of the row before, d_j)."""
    m = len(tokens)
    ids = torch.tensor(tokens)
    _, hidden = target(ids, BatchMetadata.for_prompts([m]), None, hidden_layers=eagle.config.aux_layers)  # [m, 3H]
    features = eagle.fc(hidden[: m - 1])  # [m-1, H]
    inputs = tokens[1:]
    rows = []
    for j in range(len(drafts) + 1):
        logits, g = eagle(torch.tensor(inputs), BatchMetadata.for_prompts([len(inputs)]), None, features, project=False)
        full = torch.full((1, eagle.t2d.numel()), float("-inf"))
        full[0, eagle.draft_to_target(torch.arange(eagle.config.draft_vocab_size))] = logits[-1]
        rows.append(warp_probs(full, [params])[0])
        if j < len(drafts):
            features = torch.cat([features, g[-1:]])
            inputs = inputs + [drafts[j]]
    return torch.stack(rows[: len(drafts)])  # [n, V]


def recorded_proposals(llm: LLM, prompts, params) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Run generate, recording every proposal: (the sequence's tokens, its drafts, q rows [n, V]);
    the EAGLE head's own, when prompt lookup stands in front of it."""
    with recording_proposals(getattr(llm.engine.drafter, "model_drafter", llm.engine.drafter)) as seen:
        llm.generate(prompts, params)
    return [(tokens, drafts, q[: len(drafts)]) for _, tokens, _, drafts, q in seen if drafts]


PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [100, 3, 77, 12, 9, 250, 31, 8], [2]]


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=20, seed=seed, ignore_eos=True)


def check_catch_up(target, eagle, llm: LLM, prompts=PROMPTS) -> tuple[int, float]:
    """Compare every recorded proposal with the fresh reference; returns (proposals compared,
    largest |q - q_fresh|). The batch's requests have mixed accept/reject histories."""
    params = [sampled(i) for i in range(len(prompts))]
    seen = recorded_proposals(llm, prompts, params)
    by_prompt = {tuple(p): sp for p, sp in zip(prompts, params)}
    worst = 0.0
    for tokens, drafts, q in seen:
        sp = next(v for p, v in by_prompt.items() if tuple(tokens[: len(p)]) == p)
        worst = max(worst, (q - fresh_proposals(target[0], eagle, tokens, drafts, sp)).abs().max().item())
    return len(seen), worst


def test_every_proposal_equals_a_fresh_drafter_on_the_accepted_prefix(target, eagle):
    """After any history (sampled requests, k = 3, drafts accepted and rejected), q_1..q_n of every
    proposal equal a fresh drafter's over the same accepted prefix (max diff < 1e-5)."""
    llm = LLM(model=target, draft_model=eagle, num_speculative_tokens=3, kv_cache_gib=0.01, page_size=4)
    n, worst = check_catch_up(target, eagle, llm)
    metrics = llm.last_metrics
    assert 0 < metrics.acceptance_rate < 1, "the history must hold both accepted and rejected drafts"
    assert n >= 4 * len(PROMPTS) and worst < 1e-5


def test_steps_drafted_by_prompt_lookup_leave_the_heads_proposals_exact(target, eagle):
    """With prompt lookup in front (drafters/lookup.py), the head skips the steps lookup drafts and catches
    up on all their positions the next time it drafts: every proposal it makes still equals a
    fresh drafter's over the accepted prefix. Lookup is made to fire on every sequence length
    divisible by 3 (proposing its last tokens again: how lookup finds its tokens is not what is
    tested), so the head drafts right after looked-up steps in the middle of requests, many times."""
    llm = LLM(model=target, draft_model=eagle, num_speculative_tokens=3, kv_cache_gib=0.01, page_size=4,
              prompt_lookup_min=1)
    hybrid = llm.engine.drafter
    hybrid.lookup.lookup = lambda tokens, k: tokens[-k:] if len(tokens) % 3 == 0 else []
    with recording_proposals(hybrid) as steps:
        n, worst = check_catch_up(target, eagle, llm)
    kinds: dict[int, list[str]] = {}  # request id -> who drafted at each step ("lookup" / "head" / "none")
    for request_id, tokens, _, drafts, _ in steps:
        kinds.setdefault(request_id, []).append("lookup" if drafts and len(tokens) % 3 == 0 else "head" if drafts else "none")
    after_lookup = sum(1 for ks in kinds.values() for i in range(2, len(ks)) if ks[i] == "head" and ks[i - 1] == "lookup")
    assert after_lookup >= len(PROMPTS) and n >= 2 * len(PROMPTS) and worst < 1e-5


def test_a_drafter_without_the_catch_up_fails_the_same_check(target, eagle, monkeypatch):
    """Power: keeping the K/V the chained steps computed from the draft's own features for the
    accepted drafts (catching up on the last position only, the reported engine bug) changes
    later proposals, and the check above sees it."""
    original = EagleDrafter.observe

    def observe_last_only(self, seqs, starts, num_fed, hidden):
        original(self, seqs, starts, num_fed, hidden)
        for s in seqs:
            p = s.draft_state
            if p is not None and p.rows.shape[0] > 1 and s.draft_table.num_cached > 0:
                p.rows, p.start = p.rows[-1:], p.end - 1

    monkeypatch.setattr(EagleDrafter, "observe", observe_last_only)
    monkeypatch.setattr(EagleDrafter, "rollback", lambda self, seqs: [
        s.draft_table.truncate(s.draft_state.start, self.runner.cache.allocator) for s in seqs if s.draft_state is not None])
    llm = LLM(model=target, draft_model=eagle, num_speculative_tokens=3, kv_cache_gib=0.01, page_size=4)
    n, worst = check_catch_up(target, eagle, llm)
    assert n > 0 and worst > 1e-3


# --- hidden states -----------------------------------------------------------------------------


def test_the_target_returns_hf_hidden_states_only_when_asked(tiny_llama, target):
    import transformers

    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    meta = BatchMetadata.for_prompts([6])
    plain = target[0](ids, meta)
    assert isinstance(plain, torch.Tensor)
    logits, hidden = target[0](ids, meta, None, hidden_layers=(2, 0, 1))
    torch.testing.assert_close(logits, plain)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(ids[None], output_hidden_states=True).hidden_states  # entry i: input of layer i
    H = target[0].cfg.hidden_size
    # HF's last entry has the final norm applied; ours (layer 2 = the last layer's output) does not.
    torch.testing.assert_close(hidden[:, H : 2 * H], states[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[:, 2 * H :], states[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(target[0].norm(hidden[:, :H]), states[2][0], atol=1e-5, rtol=1e-5)


# --- checkpoints -------------------------------------------------------------------------------


def test_the_official_layout_round_trips(target, eagle, tmp_path):
    """save_eagle writes exactly the official tensor names (no embedding) and a config that
    is_eagle_checkpoint detects; loading gives the same model (bf16 rounding aside)."""
    save_eagle(eagle, tmp_path, torch.float32)
    assert set(load_file(tmp_path / "model.safetensors")) == OFFICIAL_TENSORS
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == eagle.config.draft_vocab_size
    assert is_eagle_checkpoint(tmp_path) and not is_eagle_checkpoint(tmp_path / "nowhere")
    again = load_eagle(tmp_path, target[0])
    for (k, a), (_, b) in zip(eagle.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert again.embed_weight.data_ptr() == target[0].embed_tokens.weight.data_ptr(), "the embedding is shared"


def test_a_checkpoint_written_by_another_tool_loads(target, tmp_path):
    """The layout as published (Llama config, 'LlamaForCausalLMEagle3', draft_vocab_size,
    target_hidden_size, a 'model.' prefix on nothing, d2t int64, t2d bool, its own embedding)
    loads and drafts; a greedy run equals plain greedy decoding."""
    t, tok = target
    V, H = t.cfg.vocab_size, t.cfg.hidden_size
    keep = torch.tensor(sorted(set(range(0, V, 3)) | {1}))
    Vd = len(keep)
    torch.manual_seed(0)
    shapes = {
        "fc.weight": (H, 3 * H), "midlayer.self_attn.q_proj.weight": (t.cfg.num_heads * t.cfg.head_dim, 2 * H),
        "midlayer.self_attn.k_proj.weight": (t.cfg.num_kv_heads * t.cfg.head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": (t.cfg.num_kv_heads * t.cfg.head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, t.cfg.num_heads * t.cfg.head_dim),
        "midlayer.mlp.gate_proj.weight": (96, H), "midlayer.mlp.up_proj.weight": (96, H), "midlayer.mlp.down_proj.weight": (H, 96),
        "lm_head.weight": (Vd, H), "embed_tokens.weight": (V, H),
    }
    state = {k: 0.1 * torch.randn(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    for k in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        state[f"{k}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    state["d2t"] = keep - torch.arange(Vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    state["t2d"] = t2d
    save_file(state, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": H, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": t.cfg.num_heads,
              "num_key_value_heads": t.cfg.num_kv_heads, "rms_norm_eps": 1e-5, "vocab_size": V, "draft_vocab_size": Vd,
              "target_hidden_size": H, "max_position_embeddings": 64, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=target, speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3},
              kv_cache_gib=0.01, page_size=8)
    assert isinstance(llm.engine.drafter, EagleDrafter)
    assert llm.engine.drafter.model.config.aux_layers == (0, 1, 2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=target, kv_cache_gib=0.01, page_size=8).generate(PROMPTS, params)
    spec = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.last_metrics.num_drafted > 0


def edit(path, config: dict | None = None, tensors: dict | None = None, drop: tuple = ()) -> None:
    if config:
        c = json.loads((path / "config.json").read_text())
        c.update(config)
        (path / "config.json").write_text(json.dumps(c))
    if tensors or drop:
        state = load_file(path / "model.safetensors")
        state.update(tensors or {})
        save_file({k: v for k, v in state.items() if k not in drop}, str(path / "model.safetensors"))


BAD = [
    ({"hidden_size": 32}, None, (), "hidden_size 32 but the target's is 64"),
    ({"target_hidden_size": 128}, None, (), "target with hidden size 128; this target's is 64"),
    ({"vocab_size": 999}, None, (), "vocab_size 999 but the target's is"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}, None, (), "reads target layers [0, 1, 5]; the target has 2 layers"),
    ({"num_hidden_layers": 2}, None, (), "num_hidden_layers 2; an EAGLE-3 draft has 1"),
    (None, None, ("fc.weight",), "is missing tensors: fc.weight"),
    (None, {"d2t": torch.full((160,), 10**6, dtype=torch.int64)}, (), "d2t must map the 160 draft ids to distinct ids"),
    (None, {"lm_head.weight": torch.zeros(7, 64)}, (), "tensor lm_head.weight has shape (7, 64)"),
]


@pytest.mark.parametrize("config,tensors,drop,message", BAD, ids=[b[3][:30] for b in BAD])
def test_a_checkpoint_that_does_not_fit_its_target_is_refused_by_name(target, eagle, tmp_path, config, tensors, drop, message):
    save_eagle(eagle, tmp_path, torch.float32)
    edit(tmp_path, config, tensors, drop)
    with pytest.raises(ValueError) as err:
        LLM(model=target, draft_model=str(tmp_path), kv_cache_gib=0.01)
    assert message in str(err.value) and str(tmp_path) in str(err.value)


def test_method_eagle3_on_a_plain_draft_is_refused(target, tiny_llama_draft):
    with pytest.raises(ValueError, match="needs an EAGLE-3 checkpoint"):
        LLM(model=target, speculative_config={"method": "eagle3", "model": str(tiny_llama_draft)})


def test_drafting_stops_at_the_drafts_context_and_output_is_unchanged(target, tiny_llama_eagle, tmp_path):
    """A head with max_position_embeddings 16 (below the target's 512): requests past it are
    simply not drafted (the output is the target's, greedy identity holds)."""
    save_eagle(load_eagle(tiny_llama_eagle, target[0]), tmp_path, torch.float32)
    edit(tmp_path, {"max_position_embeddings": 16})
    llm = LLM(model=target, draft_model=str(tmp_path), num_speculative_tokens=3, kv_cache_gib=0.01, page_size=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(model=target, kv_cache_gib=0.01, page_size=8).generate([[5, 6, 7]], params)
    spec = llm.generate([[5, 6, 7]], params)
    assert spec[0].token_ids == plain[0].token_ids
    m = spec[0].metrics
    assert 0 < m.num_drafted and m.num_steps > 30 - 16  # drafting stopped; one token per step after


def test_init_eagle_maps_its_vocabulary_both_ways(target):
    ids = torch.tensor([9, 1, 4, 200])
    e = init_eagle(target[0], ids, aux_layers=(0, 1, 2))
    assert e.draft_to_target(torch.arange(4)).tolist() == [1, 4, 9, 200]
    assert e.t2d.nonzero().flatten().tolist() == [1, 4, 9, 200]
    assert dataclasses.asdict(e.config)["aux_layers"] == (0, 1, 2)
    assert minispec.io.eagle_checkpoint.hf_config(e.config)["draft_vocab_size"] == 4


def test_stream_logprobs_and_stop_strings_with_the_feature_drafter(target, eagle):
    """stream() yields what generate() returns; logprobs equal plain decoding's (they are the
    target's); a stop string ends the text where plain decoding ends it."""
    plain = LLM(model=target, kv_cache_gib=0.01, page_size=8)
    llm = LLM(model=target, draft_model=eagle, num_speculative_tokens=3, kv_cache_gib=0.01, page_size=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    streamed = [[] for _ in PROMPTS]
    for event in llm.stream(PROMPTS, params):
        streamed[event.index] += event.new_token_ids
    outs, ref = llm.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert streamed == [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for o, r in zip(outs, ref):
        assert [sorted(d) for d in o.logprobs] == [sorted(d) for d in r.logprobs]
        for d, e in zip(o.logprobs, r.logprobs):
            assert all(abs(d[t].logprob - e[t].logprob) < 1e-4 for t in d)
    stop = target[1].decode(ref[0].token_ids[3:5])
    assert stop.strip(), "tokens 3-4 of the first greedy answer should print something"
    stopped = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    a, b = llm.generate(PROMPTS[:1], stopped)[0], plain.generate(PROMPTS[:1], stopped)[0]
    assert a.finish_reason == "stop" and (a.text, a.token_ids) == (b.text, b.token_ids)


def test_the_training_forward_is_the_drafting_forward(target, eagle):
    """training/train_eagle.py's unrolled training-time test computes, at step i and index t, the
    logits the drafter computes at inference for the chained draft position t+i fed the true
    tokens (the fresh cache-free reference above): training and drafting cannot drift apart."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "training" / "train_eagle.py"
    spec = importlib.util.spec_from_file_location("train_eagle", path)
    train_eagle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_eagle)
    tokens = [5, 6, 7, 8, 9, 100, 3, 77, 12, 9]
    ids = torch.tensor(tokens)
    with torch.inference_mode():
        _, hidden = target[0](ids, BatchMetadata.for_prompts([len(ids)]), None, hidden_layers=eagle.config.aux_layers)
        steps = list(train_eagle.unrolled_logits(eagle, ids[None], hidden[None], 3))  # 3 x [1, T, V_d]
    params = SamplingParams(temperature=1.0)
    for t in (0, 3, 5):
        # positions 0..t from the target's features, then drafts = the true next tokens
        fresh = fresh_proposals(target[0], eagle, tokens[: t + 2], tokens[t + 2 : t + 4], params)  # [2, V]
        for i in range(2):
            expected = steps[i][0, t].softmax(-1)
            torch.testing.assert_close(fresh[i][eagle.t2d], expected, atol=1e-5, rtol=1e-4)
