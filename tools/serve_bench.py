"""Served throughput, time to first token and inter-token latency at a few concurrencies, with
and without speculation, against offline `LLM.generate` of the same requests, in paired rounds.

    python tools/serve_bench.py [--requests 16] [--max-tokens 48] [--concurrency 1,4,16] [--rounds 3] [--dtype bfloat16]

The arms: the default target's EAGLE-3 head with speculation by load (serve's default), the head
at a fixed k = 4, no drafter; each `minispec serve` in its own process on a free loopback port,
all three started first. Each round runs, for every concurrency c, every arm in turn (the order
rotated round by round, so a slow minute of the machine falls on every arm alike): the same
seeded requests sent by c client threads (streaming, so the first token's arrival is seen); then
the same requests through `LLM.generate` in one call, per arm. Printed: per arm and c the median
tokens/s over the rounds, p50 / p99 TTFT and inter-token latency over all of them; then the ratios
measured within each round (an arm against plain at the same c, served against offline), their
median and [min, max].
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
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


def one_request(url: str, prompt: str, seed: int, max_tokens: int) -> tuple[float, int, list[float]]:
    """(seconds to the first token, tokens, seconds between its content chunks) of one streamed chat request."""
    import httpx

    start, first, tokens, arrivals = time.perf_counter(), None, 0, []
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.7, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                arrivals.append(time.perf_counter())
                first = first if first is not None else arrivals[0] - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or 0.0, tokens, [b - a for a, b in zip(arrivals, arrivals[1:])]


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of sorted xs (the nearest rank below)."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def start_server(draft: str, dtype: str, flags: list[str]):
    """`minispec serve` in its own process (the clients here do not share its interpreter)."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minispec", "serve", "--draft", draft, "-k", "4", "--dtype", dtype,
                             "--port", str(port), *flags], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the server did not start")


def serve_round(url: str, prompts: list[str], c: int, max_tokens: int) -> tuple[float, list[float], list[float]]:
    """(tokens/s, TTFTs, inter-token gaps) of the requests sent by c client threads."""
    start = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(pool.map(lambda i: one_request(url, prompts[i], i, max_tokens), range(len(prompts))))
    wall = time.perf_counter() - start
    return sum(r[1] for r in results) / wall, [r[0] for r in results], [g for r in results for g in r[2]]


def ratio_line(label: str, ratios: list[float]) -> str:
    return f"  {label:44} {statistics.median(ratios):5.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


def main(argv=None) -> int:
    import signal

    from minispec import LLM, SamplingParams
    from minispec.io.paths import default_eagle_head, default_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or not args.concurrency.strip():
        raise SystemExit("--rounds and --requests must be >= 1, --concurrency a list such as 1,4,16")
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "weights" / "prompts" / "bench.jsonl").read_text().splitlines()]
    prompts = prompts[: args.requests]
    levels = [int(x) for x in args.concurrency.split(",")]
    eagle = str(default_eagle_head())
    arms = [("eagle k<=4 by load", eagle, []), ("eagle k=4", eagle, ["--no-speculation-by-load"]), ("plain", "none", [])]
    servers, offline = {}, {}
    try:
        for name, draft, flags in arms:
            servers[name] = start_server(draft, args.dtype, flags)
            one_request(servers[name][1], prompts[0], 0, 4)  # warm-up
            llm = LLM(str(default_target()), draft_model=None if draft == "none" else draft,
                      num_speculative_tokens=None if draft == "none" else 4, dtype=args.dtype,
                      speculation_by_load=not flags and draft != "none")
            chats = [llm.tokenizer.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
            params = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
                      for i in range(len(prompts))]
            llm.generate(chats[:1], params[:1], use_tqdm=False)  # warm-up
            offline[name] = (llm, chats, params)
        rate = {(a, c): [] for a, _, _ in arms for c in levels + [0]}  # c = 0: offline
        ttft, itl = {key: [] for key in rate}, {key: [] for key in rate}
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            for c in levels:
                for name, _, _ in order:
                    tok_s, firsts, gaps = serve_round(servers[name][1], prompts, c, args.max_tokens)
                    rate[name, c].append(tok_s)
                    ttft[name, c] += firsts
                    itl[name, c] += gaps
            for name, _, _ in order:
                llm, chats, params = offline[name]
                start = time.perf_counter()
                outs = llm.generate(chats, params, use_tqdm=False)
                rate[name, 0].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        for name, _, _ in arms:
            for c in levels:
                t, g = sorted(ttft[name, c]), sorted(itl[name, c])
                print(f"{name:18} concurrency {c:3}: {statistics.median(rate[name, c]):7.1f} tok/s, TTFT p50 "
                      f"{statistics.median(t) * 1e3:5.0f} ms, p99 {pct(t, 0.99) * 1e3:5.0f} ms; inter-token p50 "
                      f"{statistics.median(g) * 1e3:5.0f} ms, p99 {pct(g, 0.99) * 1e3:5.0f} ms")
            print(f"{name:18} offline LLM.generate, one call (median of rounds): {statistics.median(rate[name, 0]):7.1f} tok/s")
        print(f"ratios within each round ({args.rounds} rounds): median [min, max]")
        for name, _, _ in arms[:-1]:
            for c in levels:
                print(ratio_line(f"{name} / plain, concurrency {c}", [a / b for a, b in zip(rate[name, c], rate["plain", c])]))
        top = max(levels)
        for name, _, _ in arms:
            print(ratio_line(f"{name}: served at {top} / offline", [a / b for a, b in zip(rate[name, top], rate[name, 0])]))
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGINT)
        for proc, _ in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
