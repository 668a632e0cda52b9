"""Served throughput and time to first token at a few concurrencies, with and without speculation,
against offline `LLM.generate` of the same requests.

    python tools/serve_bench.py [--requests 16] [--max-tokens 48] [--concurrency 1,4,16] [--dtype bfloat16]

For each drafter (the default target's EAGLE-3 head, and none): `minispec serve` in its own
process on a free loopback port; for each concurrency c, the same seeded requests sent by c client
threads (streaming, so the first token's arrival is seen); total tokens/s, p50 / p99 TTFT; then
the same requests through `LLM.generate` in one call, for comparison.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(url: str, prompt: str, seed: int, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed chat request."""
    import httpx

    start, first, tokens = time.perf_counter(), None, 0
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.7, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or 0.0, tokens


def start_server(draft: str, dtype: str):
    """`minispec serve` in its own process (the clients here do not share its interpreter)."""
    import subprocess

    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minispec", "serve", "--draft", draft, "-k", "4", "--dtype", dtype,
                             "--port", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the server did not start")


def main(argv=None) -> int:
    import signal

    from minispec import LLM, SamplingParams
    from minispec.io.paths import default_eagle_head, default_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "weights" / "prompts" / "bench.jsonl").read_text().splitlines()]
    prompts = prompts[: args.requests]
    for name, draft in (("eagle k=4", str(default_eagle_head())), ("plain", "none")):
        proc, url = start_server(draft, args.dtype)
        try:
            one_request(url, prompts[0], 0, 4)  # warm-up
            for c in (int(x) for x in args.concurrency.split(",")):
                start = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    results = list(pool.map(lambda i: one_request(url, prompts[i], i, args.max_tokens), range(len(prompts))))
                wall = time.perf_counter() - start
                ttft = sorted(r[0] for r in results)
                print(f"{name:10} concurrency {c:3}: {sum(r[1] for r in results) / wall:7.1f} tok/s, TTFT p50 "
                      f"{statistics.median(ttft) * 1e3:7.0f} ms, p99 {ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3:7.0f} ms",
                      flush=True)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        llm = LLM(str(default_target()), draft_model=None if draft == "none" else draft,
                  num_speculative_tokens=None if draft == "none" else 4, dtype=args.dtype)
        chats = [llm.tokenizer.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
        params = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, ignore_eos=True) for i in range(len(prompts))]
        llm.generate(chats[:1], params[:1], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(chats, params, use_tqdm=False)
        wall = time.perf_counter() - start
        print(f"{name:10} offline LLM.generate, one call: {sum(len(o.token_ids) for o in outs) / wall:7.1f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
