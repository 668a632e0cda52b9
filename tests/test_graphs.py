"""Graph-ready steps (runtime/static_shapes.py): the static-shape layout gives the dynamic path's answers.

On CPU the static layout runs eagerly; it is exactly what a CUDA graph replays on a GPU. Invariants:
  * with static_shapes=True, greedy, seeded sampled and pathwise outputs equal the dynamic path's
    token for token, and the target's log-probabilities (its logits) agree to fp32 rounding, for
    plain decoding and every drafter, with batches that do not fill their bucket (padding sequences)
    and with preemption;
  * steps that feed more tokens than a bucket holds (prompts) take the dynamic path;
  * the same holds with the Triton kernels (interpreter);
  * with static_shapes=True, every model drafter (a draft model or an EAGLE head; chained, as a
    tree, behind prompt lookup) runs every forward of every runner statically once no prompt is
    being fed (warm-up: see test_no_forward_is_dynamic_after_warm_up);
  * a failed graph capture is an error naming the runner and the bucket.
"""

from __future__ import annotations

import math

import pytest
import torch

from minispec import LLM, SamplingParams
from minispec.runtime.static_shapes import RowInput, StaticShapes

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the quick brown fox", "hello world", "to be or not to be, that is"]


MODEL_DRAFTERS = ["draft", "eagle", "draft-tree", "eagle-tree", "lookup+draft", "lookup+eagle"]  # every model drafter's step


def drafter_args(name, tiny_llama_draft, tiny_llama_eagle) -> dict:
    """A drafter by name: a draft model or an EAGLE head, chained, as a tree, or behind prompt lookup."""
    if name in ("none", "ngram"):
        return {"none": {}, "ngram": dict(draft_model="ngram", num_speculative_tokens=3)}[name]
    lookup, _, model = name.rpartition("+")
    model, _, tree = model.partition("-")
    args = dict(draft_model=str(tiny_llama_eagle if model == "eagle" else tiny_llama_draft), num_speculative_tokens=3)
    if tree:
        args.update(draft_tree_budget=6, draft_tree_top_k=2)
    if lookup:
        args.update(prompt_lookup_min=1)
    return args


@pytest.mark.parametrize("drafter", ["none", "ngram"] + MODEL_DRAFTERS)
def test_static_shapes_give_the_dynamic_paths_tokens_and_logits(tiny_llama, tiny_llama_draft, tiny_llama_eagle, drafter):
    args = dict(model=str(tiny_llama), kv_cache_gib=0.01, **drafter_args(drafter, tiny_llama_draft, tiny_llama_eagle))
    dynamic, static = LLM(**args, cuda_graphs=False), LLM(**args, static_shapes=True)  # CUDA defaults to graphs
    assert static.engine.target.static is not None and dynamic.engine.target.static is None
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3)] + [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=14, ignore_eos=True, seed=i, logprobs=3) for i in range(2)]
    a, b = dynamic.generate(PROMPTS, params), static.generate(PROMPTS, params)  # 3 sequences: bucket 4
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        for da, db in zip(x.logprobs, y.logprobs):
            assert da.keys() == db.keys() and all(math.isclose(da[t].logprob, db[t].logprob, abs_tol=1e-4) for t in da)
    target = static.engine.target.static
    assert (4, target.query_len) in target.buckets
    assert static.last_metrics.num_steps == dynamic.last_metrics.num_steps


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft", "eagle", "lookup+eagle"])
def test_pathwise_steps_with_static_shapes_give_the_dynamic_paths_tokens(tiny_llama, tiny_llama_draft,
                                                                        tiny_llama_eagle, drafter):
    """Pathwise requests (greedy and sampled, beside a standard one) without logprobs take the
    one-upload step, whose Gumbel noise is made on the device: static shapes give the dynamic
    path's tokens."""
    args = dict(model=str(tiny_llama), kv_cache_gib=0.01, **drafter_args(drafter, tiny_llama_draft, tiny_llama_eagle))
    dynamic, static = LLM(**args, cuda_graphs=False), LLM(**args, static_shapes=True)
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, pathwise=True),
              SamplingParams(temperature=0.9, top_p=0.95, max_tokens=14, ignore_eos=True, seed=1, pathwise=True),
              SamplingParams(temperature=0.9, top_k=20, max_tokens=14, ignore_eos=True, seed=2)]
    a, b = dynamic.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_static_shapes_with_preemption_and_one_sequence(tiny_llama, tiny_llama_draft):
    """Small pools force preemption (recomputed prompts go through the dynamic path, their later
    steps through the static one); a single request uses bucket 1."""
    args = dict(model=str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, page_size=4)
    roomy = LLM(**args, kv_cache_gib=0.01)
    tight = LLM(**args, kv_cache_gib=12 * 4 * 64 * 4 * 3 / 2**30, static_shapes=True)
    params = [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=i) for i in range(3)]
    assert [o.token_ids for o in tight.generate(PROMPTS, params)] == [o.token_ids for o in roomy.generate(PROMPTS, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    one = tight.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert one.token_ids == roomy.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    assert any(batch == 1 for batch, _ in tight.engine.target.static.buckets)


def test_a_draft_with_a_shorter_context_and_many_slots(tiny_llama, checkpoint_factory):
    """The draft pool reserves pages for the target's length, past the draft's own context (here
    24 positions): its static block tables keep only the pages it can read (it used to raise a
    numpy broadcast error). max_num_seqs past the largest bucket is fine: larger batches go dynamic."""
    short = checkpoint_factory("llama", seed=1, num_hidden_layers=1, max_position_embeddings=24)
    args = dict(model=str(tiny_llama), draft_model=str(short), num_speculative_tokens=3, kv_cache_gib=0.01,
                max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = LLM(**args).generate(PROMPTS, params)
    assert [o.token_ids for o in LLM(**args, static_shapes=True).generate(PROMPTS, params)] == [o.token_ids for o in expected]
    many = LLM(model=str(tiny_llama), kv_cache_gib=0.01, max_num_seqs=512, static_shapes=True)
    assert many.engine.target.static.batches[-1] == 256


def test_prompts_take_the_dynamic_path(tiny_llama):
    llm = LLM(model=str(tiny_llama), kv_cache_gib=0.01, static_shapes=True)
    static = llm.engine.target.static
    calls = []
    run = static.run
    static.run = lambda prepared, *a, **kw: calls.append([len(f.tokens) for f in prepared.feeds]) or run(prepared, *a, **kw)
    llm.generate(["a much longer prompt than one token"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert calls == [[1]] * 3  # the prompt's step was dynamic; the 3 decode steps static


def test_static_shapes_with_the_triton_kernels(tiny_llama, tiny_llama_draft):
    """The Triton kernels (interpreter, fp32) on the static layout: padding sequence, empty slots,
    launch sizes fixed per bucket."""
    args = dict(model=str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=2, kv_cache_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [o.token_ids for o in LLM(**args).generate(PROMPTS, params)]  # (the twins, dynamic: fp32 greedy is the same)
    static = LLM(**args, backend="triton", static_shapes=True)
    assert [o.token_ids for o in static.generate(PROMPTS, params)] == expected
    counts = static.engine.target.forward_counts
    assert counts["static"] + counts["graph"] > 0  # (on a GPU the static forwards replay graphs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="captures fail only where there is no CUDA")
def test_a_failed_capture_is_an_error_naming_the_bucket(tiny_llama, tiny_llama_eagle):
    """On CPU every capture fails (no CUDA): an error naming the runner and the bucket (batch size,
    query length), never a silent eager fallback (a GPU run would stay launch-bound unnoticed)."""
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_eagle), num_speculative_tokens=3, kv_cache_gib=0.01)
    with pytest.raises(RuntimeError, match="the target runner's bucket of batch 1, query length 2") as error:
        llm.engine.target.use_static_shapes(2, 4, cuda_graphs=True)
    assert error.value.__cause__ is not None  # what the capture raised, kept
    head = llm.engine.runners[1][0]
    head.static = StaticShapes(head, (1, 4), 4, role="draft", carry_at_logit_rows=True)
    with pytest.raises(RuntimeError, match=r"the draft runner's bucket of batch 1, query length 1 \(.*project=True"):
        head.static.capture([dict(hidden=RowInput(3 * 64, torch.float32), project=True)])
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(model=str(tiny_llama), kv_cache_gib=0.01, cuda_graphs=True)


@pytest.mark.parametrize("backends, default", [(("triton", "triton"), True), (("triton", "torch"), False),
                                               (("invariant",), False)])
def test_graphs_run_only_models_on_the_triton_kernels(backends, default):
    """The torch twins and the invariant backend plan attention on the host from each forward's
    metadata: a graph would freeze its capture's plan. On CUDA (faked here: the choice reads the
    models' device and backend) graphs are on by default only when every model runs the Triton
    kernels, and asking for them otherwise is an error naming the backend."""
    from types import SimpleNamespace

    from minispec.build import use_cuda_graphs
    from minispec.options import EngineOptions

    models = [SimpleNamespace(device=torch.device("cuda"), backend=SimpleNamespace(name=b)) for b in backends]
    assert use_cuda_graphs(EngineOptions(model="m"), models) is default
    if not default:
        with pytest.raises(ValueError, match=f"the {backends[-1]} attention backend plans each forward"):
            use_cuda_graphs(EngineOptions(model="m", cuda_graphs=True), models)


def test_the_padding_never_touches_a_sequences_pages(tiny_llama):
    """The padding rows write only the scratch page: every other slot of the pool holds what the
    dynamic path leaves there (the same slots written, values equal up to fp32 rounding: the
    projections ran over more rows)."""
    args = dict(model=str(tiny_llama), kv_cache_gib=0.01, page_size=4)
    dynamic, static = LLM(**args, cuda_graphs=False), LLM(**args, static_shapes=True)  # CUDA defaults to graphs
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    dynamic.generate(PROMPTS, params)
    static.generate(PROMPTS, params)
    pages = dynamic.engine.target.cache.num_pages
    a, b = dynamic.engine.target.cache.pool[:, :, :pages], static.engine.target.cache.pool[:, :, :pages]
    assert torch.equal(a != 0, b != 0)  # the same slots written
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert static.engine.target.cache.pool[:, :, pages].abs().sum() > 0  # the scratch page was written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (tools/gpu_check.sh runs this)")
@pytest.mark.parametrize("drafter", ["none"] + MODEL_DRAFTERS)
def test_cuda_graphs_replay_what_eager_computes(tiny_llama, tiny_llama_draft, tiny_llama_eagle, drafter):
    args = dict(model=str(tiny_llama), kv_cache_gib=0.01, max_num_seqs=8,
                **drafter_args(drafter, tiny_llama_draft, tiny_llama_eagle))
    graphs, eager = LLM(**args, cuda_graphs=True), LLM(**args, cuda_graphs=False)
    for runner, _ in graphs.engine.runners:  # (a failed capture raises while building)
        assert runner.static is not None and all(b.graphs for b in runner.static.buckets.values())
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] + [
        SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=i) for i in range(2)]
    assert [o.token_ids for o in graphs.generate(PROMPTS, params)] == [o.token_ids for o in eager.generate(PROMPTS, params)]


def test_no_sequence_of_a_static_bucket_has_more_rows_than_the_launch_covers(tiny_llama):
    """The kernels launch max_query_len = Q rows per sequence; one padding sequence used to take
    every row left (up to B*Q), so on the Triton path some padding rows were never computed
    (garbage, possibly NaN, in the graph's buffers; found in review). Padding now comes in
    sequences of at most Q rows, for every bucket after real steps and as captured (all padding)."""
    llm = LLM(model=str(tiny_llama), draft_model="ngram", num_speculative_tokens=3, kv_cache_gib=0.01,
              static_shapes=True, max_num_seqs=4)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    static = llm.engine.target.static
    assert static.buckets
    for bucket in list(static.buckets.values()) + [static.bucket(4, static.query_len)]:
        for feeds in ([], None):
            if feeds is not None:
                static.fill(bucket, feeds)
            m = bucket.meta
            q_lens = m.query_start_loc.diff()
            assert int(q_lens.max()) <= m.max_query_len and int(m.query_start_loc[-1]) == bucket.batch * bucket.query_len


def trace_forwards(llm) -> list[tuple[str, str, bool]]:
    """Wrap every runner's forward (its prepare and run halves) to log (runner role, path taken:
    graph / static / dynamic, whether it fed some sequence from position 0, i.e. a prompt)."""
    log = []
    for runner, role in llm.engine.runners:
        def prepare(feeds, upload, _prepare=runner.prepare):
            from_start = any(f.table.num_cached == 0 for f in feeds)
            prepared = _prepare(feeds, upload)
            prepared.from_start = from_start
            return prepared

        def run(prepared, *args, _run=runner.run, _runner=runner, _role=role, **model_args):
            before = dict(_runner.forward_counts)
            out = _run(prepared, *args, **model_args)
            log.append((_role, next(p for p, n in _runner.forward_counts.items() if n != before[p]), prepared.from_start))
            return out

        runner.prepare, runner.run = prepare, run
    return log


REPEATING = ["one two three one two three one two", "a b a b a b a", "x y z x y z"]  # prompt lookup finds matches


@pytest.mark.parametrize("batch", [1, 3])  # 3: a partly filled bucket of 4
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("drafter", MODEL_DRAFTERS)
def test_no_forward_is_dynamic_after_warm_up(tiny_llama, tiny_llama_draft, tiny_llama_eagle, drafter, mode, batch):
    """With static_shapes=True, once warm-up is over no forward of any runner (the target, the
    draft model or EAGLE head) takes the dynamic path, while static forwards go on.

    Warm-up: every forward up to the last one that feeds some sequence from position 0, i.e. a
    prompt: the target's prefill, a draft model's first catch-up, and an EAGLE head's catch-up on
    the prompt's features, which comes in the sequence's second step (the head drafts nothing in
    the first) or, behind prompt lookup, at the first step lookup finds nothing. After it every
    feed is a step's: a verification of k + 1 tokens or a tree, a chained draft token, a tree
    level's frontier, a catch-up on accepted tokens (in bucket-sized pieces after looked-up steps)."""
    args = drafter_args(drafter, tiny_llama_draft, tiny_llama_eagle)
    llm = LLM(model=str(tiny_llama), kv_cache_gib=0.01, static_shapes=True, max_num_seqs=4, **args)
    assert all(runner.static is not None for runner, _ in llm.engine.runners)
    log = trace_forwards(llm)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if mode == "greedy" else
              SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=i) for i in range(batch)]
    llm.generate((REPEATING if "lookup" in drafter else PROMPTS)[:batch], params)
    warm_up = max(i for i, (_, _, from_start) in enumerate(log) if from_start) + 1
    after = log[warm_up:]
    assert [entry for entry in after if entry[1] == "dynamic"] == []
    for role in ("target", "draft"):  # (on a GPU the static forwards replay graphs)
        assert sum(1 for r, path, _ in after if r == role and path in ("static", "graph")) >= 3, (role, after)
    if "lookup" in drafter:
        assert llm.engine.drafter.lookup_drafts > 0 and llm.engine.drafter.model_drafts > 0


def test_the_eagle_heads_features_come_from_persistent_per_bucket_buffers(tiny_llama, tiny_llama_eagle):
    """A graph fixes addresses: every static forward of the EAGLE head reads its features (the
    target's in a catch-up, projected; its own g in a tree level) from a buffer its bucket holds
    for good, one per width; the tokens are the dynamic path's."""
    args = dict(model=str(tiny_llama), draft_model=str(tiny_llama_eagle), num_speculative_tokens=3, draft_tree_budget=6,
                draft_tree_top_k=2, kv_cache_gib=0.01)
    llm = LLM(**args, static_shapes=True, cuda_graphs=False)  # (eager: a graph's replay calls no Python)
    head = llm.engine.runners[1][0]
    calls = []  # (metadata, features, project) of each forward of the head
    model = head.model
    head.model = lambda ids, meta, caches, hidden, project: calls.append((meta, hidden, project)) or model(
        ids, meta, caches, hidden=hidden, project=project)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
    buckets = {id(b.meta): b for b in head.static.buckets.values()}
    static = [(buckets[id(meta)], hidden, project) for meta, hidden, project in calls if id(meta) in buckets]
    assert len(static) == head.forward_counts["static"] > 0 and {project for *_, project in static} == {True, False}
    for bucket, hidden, project in static:
        width = 3 * 64 if project else 64  # the target's features [n, 3H], or g [n, H]
        assert hidden is bucket.row_inputs["hidden", RowInput(width, torch.float32)]
    assert tokens == [o.token_ids for o in LLM(**args, cuda_graphs=False).generate(PROMPTS, params)]
