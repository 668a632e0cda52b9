"""`minispec serve` with prefix caching (its default): a chat that goes on turn after turn prefills
only what is new, through the official openai client, on 127.0.0.1 only.

Invariants taught here:
* turn 1 of a chat with a ~1,000-token system prompt finds nothing cached; from turn 2 on the
  system prompt and the earlier turns are found (OpenAI's usage.prompt_tokens_details.cached_tokens),
  and turn 5's time to first token is at most 1.3x turn 1's although its prompt is longer;
* the Prometheus counters vllm:prefix_cache_queries / _hits move by the prompt tokens looked up
  and found, and the live page's figures carry the hit rate;
* the answers equal those of a server without prefix caching (greedy, the same conversation);
* a client that goes away mid-stream leaves no page held, shared ones included.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from minispec import LLM  # noqa: E402
from test_server import KEY, TEMPLATE, scrape, serving  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "chatty"
SYSTEM = " ".join(["You answer questions about the quick brown fox, the lazy dog and speculative decoding."] * 19)


@pytest.fixture(scope="module")
def chat_model(checkpoint_factory, tmp_path_factory):
    """A Llama wide enough (hidden 256, 4 layers) that a 1,000-token prefill is most of a TTFT."""
    source = checkpoint_factory("llama", seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=4, max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("chatty") / NAME
    shutil.copytree(source, path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


def chat(url: str, turns: int = 5, system: str = SYSTEM) -> list[tuple[float, int, int, str]]:
    """A conversation of `turns` user turns, streamed: per turn (TTFT s, prompt tokens, cached tokens, answer)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what does the fox do next?"})
        start, ttft, text, usage = time.perf_counter(), None, "", None
        for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - start
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        out.append((ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, text))
        messages.append({"role": "assistant", "content": text})
    return out


def test_a_chat_prefills_only_what_each_turn_adds(chat_model):
    llm = LLM(model=str(chat_model), draft_model="ngram", num_speculative_tokens=3, kv_cache_gib=0.1,
              enable_prefix_caching=True)
    with serving(llm, NAME, 16) as (server, url):
        chat(url, 2, system=SYSTEM.upper())  # warm-up (oneDNN's first calls), sharing nothing with the chat below
        before = scrape(url)
        turns = chat(url, 5)
        after = scrape(url)
        stats = httpx.get(url + "/stats.json", timeout=30).json()
        body = {"model": NAME, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}],
                "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60) as r:  # a client that goes away while holding shared pages
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
        deadline = time.monotonic() + 30
        while (llm.engine.has_unfinished() or server.loop.handles) and time.monotonic() < deadline:
            time.sleep(0.05)
        for runner, _ in llm.engine.runners:  # nothing held: every page free or kept for later hits
            assert sum(runner.cache.allocator.refs) == 0 and runner.cache.allocator.num_free == runner.cache.num_pages
    assert turns[0][1] >= 1000 and turns[0][2] < 16, "turn 1: at most the template's first page is known"
    assert all(cached >= 1000 for _, _, cached, _ in turns[1:]), "the system prompt (and the earlier turns) are found"
    assert turns[4][2] > turns[1][2]  # each turn finds more: the earlier turns too
    assert turns[4][0] <= 1.3 * turns[0][0], [t[0] for t in turns]  # (Zen 4: 0.027 s against 0.249 s)
    queried = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    found = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert queried == sum(t[1] for t in turns) and found == sum(t[2] for t in turns)
    assert 0 < stats["prefix_cache_hit_rate"] <= 1

    plain = LLM(model=str(chat_model), draft_model="ngram", num_speculative_tokens=3, kv_cache_gib=0.1)
    with serving(plain, NAME, 16) as (_, url):
        uncached = chat(url, 5)
    assert [t[3] for t in uncached] == [t[3] for t in turns] and all(t[2] == 0 for t in uncached)
