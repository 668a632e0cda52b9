"""The batched engine: continuous batching, preemption and the paged runner change nothing.

What a request generates must not depend on which other requests share its batches, when they
arrived, or whether the KV pool ran dry and it was preempted and recomputed: greedy outputs are
identical token for token, and seeded sampled outputs too (each request draws only from its own
generator). The paged runner must give the logits of a cache-free forward whatever pages it was
handed. All in fp32 on the torch backend, plus one small check of the Triton kernels.
"""

from __future__ import annotations

import random

import pytest
import torch

from minispec import LLM, BatchMetadata, KVPoolExhausted, SamplingParams, load_checkpoint
from minispec.runtime.kv_cache import BlockTable, KVCache
from minispec.runtime.runner import Feed, ModelRunner

PAGE_SIZE = 4
K = 3  # speculative tokens
PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick brown fox",
    "hello",
    "def add(a, b):\n    return a + b\n",
    "to be or not to be",
    "a draft model proposes tokens and the target",
]
MAX_TOKENS = [12, 7, 16, 9, 5]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second torch thread only contends


def bytes_per_token(drafter: str) -> int:
    """KV bytes per token of tiny_llama (2 layers, 2 KV heads, head_dim 16, fp32), plus its 1-layer draft."""
    target = 2 * 2 * 2 * 16 * 4
    return target + (target // 2 if drafter.removesuffix("+lookup") in ("model", "eagle") else 0)


@pytest.fixture(scope="module")
def make_llm(tiny_llama, tiny_llama_draft, tiny_llama_eagle):
    """make_llm(drafter="none"|"ngram"|"model"|"eagle", pages=None, **LLM kwargs): pages sizes the KV
    budget so the target pool gets exactly that many pages (None: plenty). "model+lookup" /
    "eagle+lookup": prompt lookup of >= 2 tokens in front of the model."""

    def build(drafter: str = "none", pages: int | None = None, backend: str = "torch", **kwargs) -> LLM:
        if drafter.endswith("+lookup"):
            kwargs["prompt_lookup_min"] = 2
        draft = {"none": None, "ngram": "ngram", "model": str(tiny_llama_draft),
                 "eagle": str(tiny_llama_eagle)}[drafter.removesuffix("+lookup")]
        gib = 0.01 if pages is None else (pages + 1.5) * PAGE_SIZE * bytes_per_token(drafter) / 2**30  # + scratch page
        llm = LLM(model=str(tiny_llama), draft_model=draft, num_speculative_tokens=K if draft else None, dtype=torch.float32,
                  backend=backend, page_size=PAGE_SIZE, kv_cache_gib=gib, **kwargs)
        if pages is not None:
            assert llm.engine.target.cache.num_pages == pages
        return llm

    return build


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def one_at_a_time(llm: LLM, prompts, params) -> list[list[int]]:
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def run_staggered(llm: LLM, prompts, params, arrivals: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Drive the engine by hand: request i is added just before step arrivals[i].
    Returns (each request's output, the step indices at which each request emitted tokens)."""
    engine = llm.engine
    ids = [llm.tokenizer.encode(p) for p in prompts]
    streamed: dict[int, list[int]] = {}
    emitted_at: dict[int, list[int]] = {}
    seqs = {}
    step = 0
    while len(seqs) < len(prompts) or engine.has_unfinished():
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                seqs[i] = engine.add_request(ids[i], params[i])
        for out in engine.step():
            streamed.setdefault(out.seq.request_id, []).extend(out.new_token_ids)
            emitted_at.setdefault(out.seq.request_id, []).append(step)
        step += 1
        assert step < 1000, "the engine stopped making progress"
    outputs = [seqs[i].output_ids for i in range(len(prompts))]
    assert [streamed[seqs[i].request_id] for i in range(len(prompts))] == outputs
    return outputs, [emitted_at[seqs[i].request_id] for i in range(len(prompts))]


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_staggered_batched_greedy_equals_one_request_at_a_time(make_llm, drafter):
    """Requests of different lengths joining at different steps generate exactly what each
    generates alone, with plain decoding and with either drafter."""
    llm = make_llm(drafter)
    params = [greedy(n) for n in MAX_TOKENS]
    alone = one_at_a_time(llm, PROMPTS, params)
    batched, _ = run_staggered(llm, PROMPTS, params, arrivals=[0, 0, 2, 3, 7])
    assert batched == alone
    assert [len(out) for out in batched] == MAX_TOKENS


def test_a_finished_request_frees_its_slot_for_a_waiting_one_at_once(make_llm):
    """Continuous batching: with two slots, the third request starts the step after the first
    finishes, while the second is still running (it does not wait for the whole batch)."""
    llm = make_llm("none", max_num_seqs=2)
    params = [greedy(2), greedy(10), greedy(4)]
    outputs, emitted_at = run_staggered(llm, PROMPTS[:3], params, arrivals=[0, 0, 0])
    first_done, second_done, third_start = emitted_at[0][-1], emitted_at[1][-1], emitted_at[2][0]
    assert third_start == first_done + 1
    assert second_done > third_start
    assert outputs == one_at_a_time(llm, PROMPTS[:3], params)


@pytest.mark.parametrize("drafter", ["none", "model", "eagle", "eagle+lookup"])
def test_preemption_when_the_pool_runs_dry_changes_no_output(make_llm, drafter):
    """A 12-page pool: the five requests need 3 to 12 pages each (36 in all), the longest alone
    fills it. Requests are preempted and recomputed, yet every one finishes with its
    unconstrained output, greedy and seeded-sampled alike."""
    roomy, tight = make_llm(drafter), make_llm(drafter, pages=12)
    for params in ([greedy(n) for n in MAX_TOKENS], [seeded(n, seed=i) for i, n in enumerate(MAX_TOKENS)]):
        expected = [o.token_ids for o in roomy.generate(PROMPTS, params)]
        assert roomy.last_metrics.num_preemptions == 0
        got = [o.token_ids for o in tight.generate(PROMPTS, params)]
        assert tight.last_metrics.num_preemptions > 0
        assert got == expected
    if drafter.endswith("+lookup"):  # both halves drafted
        assert tight.engine.drafter.lookup_drafts > 0 and tight.engine.drafter.model_drafts > 0
    assert all(r.cache.allocator.num_free == 12 for r, _ in tight.engine.runners), "pages leaked after the run"
    tight.generate(PROMPTS[1], greedy(3))
    assert tight.last_metrics.num_preemptions == 0, "preemptions are counted per generate call"


def test_a_request_that_can_never_fit_the_pool_is_refused_when_added(make_llm):
    """The final token is never fed back, so a request needs pages for prompt + max_tokens - 1
    positions: 10 pages of 4 hold 40, the limit is exact, and a refused request queues nothing."""
    llm = make_llm("none", pages=10)
    prompt_len = len(llm.tokenizer.encode("hello"))
    with pytest.raises(KVPoolExhausted, match="target KV pool"):
        llm.generate(["hello"], greedy(42 - prompt_len))
    with pytest.raises(ValueError, match="context length"):
        llm.generate(["hello"], greedy(512))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(["hello"], greedy(41 - prompt_len))[0].token_ids) == 41 - prompt_len


def test_stream_yields_each_requests_tokens_as_they_are_produced(make_llm):
    llm = make_llm("ngram")
    params = [greedy(n) for n in MAX_TOKENS[:3]]
    expected = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
    events = list(llm.stream(PROMPTS[:3], params))
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = []
    for event in events:
        assert event.index not in finished, "tokens after the request finished"
        got[event.index] += event.new_token_ids
        if event.finished:
            finished.append(event.index)
    assert [got[i] for i in range(3)] == expected
    assert sorted(finished) == [0, 1, 2]
    first_finish = next(i for i, e in enumerate(events) if e.finished)
    assert {e.index for e in events[:first_finish]} == {0, 1, 2}, "requests do not stream side by side"


def test_progress_line_and_kv_pool_report_go_to_stderr(make_llm, capsys):
    llm = make_llm("none", pages=12, verbose=True)
    report = capsys.readouterr().err
    assert "target KV cache: 12 pages x 4 tokens" in report and "48 tokens" in report
    llm.generate(PROMPTS[:2], greedy(3), use_tqdm=True)
    progress = capsys.readouterr().err
    assert "2/2 requests" in progress and "6 tokens" in progress


def test_runner_with_shuffled_pages_matches_a_cache_free_forward(tiny_llama):
    """Prefill, decode, multi-token verification and rollback through scattered, interleaved pages
    give the logits of one forward over the whole sequence."""
    torch.manual_seed(0)
    model, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu", backend="torch")
    vocab = model.cfg.vocab_size
    cache = KVCache(model.cfg, num_pages=40, page_size=PAGE_SIZE, dtype=torch.float32, device=torch.device("cpu"))
    allocator = cache.allocator
    pages = []
    for _ in range(40):
        allocator.allocate(pages)
    random.Random(0).shuffle(pages)
    while pages:  # the free list now hands pages out in a shuffled order
        allocator.release(pages)
    runner = ModelRunner(model, cache)
    tables = [BlockTable(PAGE_SIZE) for _ in range(2)]
    for _ in range(5):  # alternate single pages: each table's pages are scattered and interleaved
        for table in tables:
            table.reserve(table.capacity + 1, allocator)
    assert all(table.pages != sorted(table.pages) for table in tables)
    prompts = [torch.randint(vocab, (11,)).tolist(), torch.randint(vocab, (7,)).tolist()]
    tokens: list[list[int]] = [[], []]  # each table's whole history, for the fresh forward

    def feed(i: int, new: list[int], num_logits: int = 1) -> tuple[Feed, int]:
        """New tokens for table i (appended to its history)."""
        tokens[i] += new
        return Feed(tables[i], new, num_logits), i

    def check(*feeds: tuple[Feed, int]) -> None:
        """One batched forward over the feeds vs a fresh forward over each table's history."""
        logits = runner.forward([f for f, _ in feeds])  # [sum(num_logits), V]
        row = 0
        for f, i in feeds:
            fresh = model(torch.tensor(tokens[i]), BatchMetadata.for_prompts([len(tokens[i])]))  # [len, V]
            got = logits[row : row + f.num_logits]
            torch.testing.assert_close(got, fresh[len(tokens[i]) - f.num_logits :], atol=1e-4, rtol=1e-4)
            row += f.num_logits

    check(feed(0, prompts[0], 11), feed(1, prompts[1], 7))  # prefill, every row's logits
    check(feed(0, [5]), feed(1, [9]))  # decode
    check(feed(0, [1, 2, 3], 3), feed(1, [4, 5, 6, 7], 4))  # verify k+1 tokens
    tables[0].truncate(13, allocator)  # reject 2 of the 3: positions 13, 14 are stale rows now
    tokens[0] = tokens[0][:13]
    check(feed(0, [8, 8]), feed(1, [2]))  # the stale rows are overwritten
    assert len(tables[0].pages) == 4

    tables.append(BlockTable(PAGE_SIZE))  # a new prompt in the same batch as decodes (paged path)
    tokens.append([])
    check(feed(2, torch.randint(vocab, (6,)).tolist(), 6), feed(1, [3]), feed(0, [0]))
    for table in tables:
        table.free(allocator)
    assert allocator.num_free == 40


def test_triton_backend_generates_the_torch_backends_greedy_tokens(make_llm):
    """The same engine on the Triton kernels (interpreted on CPU): prefill, paged decode and
    verification with the n-gram drafter."""
    prompts, params = PROMPTS[:2], [greedy(4), greedy(3)]
    expected = [o.token_ids for o in make_llm("ngram").generate(prompts, params)]
    got = [o.token_ids for o in make_llm("ngram", backend="triton").generate(prompts, params)]
    assert got == expected


def test_abandoned_stream_frees_its_requests(tiny_llama):
    """Breaking out of llm.stream() aborts its requests: their pages return, the next call is unaffected."""
    from minispec import LLM, SamplingParams
    llm = LLM(model=str(tiny_llama))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(["hello world"], params)[0].token_ids
    free = llm.engine.target.cache.allocator.num_free
    for event in llm.stream(["the quick brown fox", "to be or not"], params):
        break
    assert llm.engine.target.cache.allocator.num_free == free
    assert not llm.engine.has_unfinished()
    assert llm.generate(["hello world"], params)[0].token_ids == expected
