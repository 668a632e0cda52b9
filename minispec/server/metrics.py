"""The server's metrics: Prometheus text at /metrics under vLLM's names (so a vLLM dashboard works),
and a rolling window of recent steps for the live page (/stats.json).

Speculative decoding, counted as vLLM counts it (labels model_name, engine="0"):
    vllm:spec_decode_num_drafts_total           +1 per request per step that carried drafts
    vllm:spec_decode_num_draft_tokens_total     drafted tokens
    vllm:spec_decode_num_accepted_tokens_total  accepted drafted tokens (the target's own token excluded)
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position=i}  +1 when drafts 0..i were all accepted
so acceptance rate = accepted / draft_tokens and mean accepted length = 1 + accepted / drafts.
Also vLLM's prompt / generation token, prefix cache (tokens looked up / found) and request
counters, running / waiting / KV-usage gauges, and TTFT, inter-token latency (one observation per step that gave a request tokens: with
speculation, step latency) and end-to-end latency histograms; plus minispec's own, where vLLM has
none: step, draft and verification time, tokens per step and batch size.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..drafters.lookup import LookupFirstDrafter
from ..drafters.tree import TreeDrafter
from ..outputs import StreamEvent

WINDOW_S = 60.0  # what the live page averages over
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0, 640.0, 2560.0)


class ServerMetrics:
    def __init__(self, model_name: str, drafter: str, k: int):
        self.registry = CollectorRegistry()  # the server's own (no process-wide state)
        self.model_name, self.drafter, self.k = model_name, drafter, k
        labels = {"model_name": model_name, "engine": "0"}
        self.labels = labels
        names = list(labels)
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, names + list(extra), registry=r)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Requests-steps that carried drafts")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Accepted drafted tokens")
        self.per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position", ["position"])
        self.prompt = counter("vllm:prompt_tokens", "Prompt tokens")
        self.generation = counter("vllm:generation_tokens", "Generated tokens")
        self.success = counter("vllm:request_success", "Finished requests", ["finished_reason"])
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", names, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", names, registry=r)
        self.k_in_use = Gauge("minispec:num_speculative_tokens", "Tokens drafted per sequence in the last step (at most)",
                              names, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the target's KV pages in use", names, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", names, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's steps", names,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", names, buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = counter("minispec:step_seconds", "Engine step time")
        self.draft_time = counter("minispec:draft_seconds", "Time in the drafter")
        self.verify_time = counter("minispec:verify_seconds", "Time in the target's verification")
        self.steps = counter("minispec:steps", "Engine steps")
        self.batch = Histogram("minispec:batch_size", "Requests per engine step", names,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.tokens_per_step = Histogram("minispec:tokens_per_step", "Tokens a request got from one step", names,
                                         buckets=tuple(range(1, 34)), registry=r)
        self.recent: deque[tuple] = deque()  # (time, drafts, draft tokens, accepted, per position list, tokens, batch)
        self.lock = threading.Lock()
        self.last_error: str | None = None
        self._times = (0.0, 0.0)
        self._preempted = 0
        self._prefix = (0, 0)  # the engine's prefix cache totals at the last step

    def prompt_tokens(self, n: int) -> None:
        self.prompt.labels(**self.labels).inc(n)

    def event(self, e: StreamEvent, since_last_s: float | None) -> None:
        """One request's tokens from one step (what `StreamEvent` says of it); since_last_s: the
        time since the request's previous step (None for its first: that wait is the TTFT)."""
        L = self.labels
        n = len(e.new_token_ids)
        if n:
            self.generation.labels(**L).inc(n)
            self.tokens_per_step.labels(**L).observe(n)
            if since_last_s is not None:
                self.itl.labels(**L).observe(since_last_s)
        if e.num_drafted:
            self.drafts.labels(**L).inc()
            self.draft_tokens.labels(**L).inc(e.num_drafted)
            self.accepted.labels(**L).inc(e.num_accepted)
            for i in range(e.num_accepted):
                self.per_pos.labels(**L, position=str(i)).inc()
        with self.lock:
            self.recent.append((time.time(), int(bool(e.num_drafted)), e.num_drafted, e.num_accepted, e.num_accepted, n, 0))
        if e.finished:
            self.success.labels(**L, finished_reason=e.finish_reason or "abort").inc()
            m = e.metrics
            if m is not None and m.ttft_s() is not None:
                self.ttft.labels(**L).observe(m.ttft_s())
            if m is not None and m.arrival_s is not None and m.finish_s is not None:
                self.e2e.labels(**L).observe(m.finish_s - m.arrival_s)

    def step(self, seconds: float, batch: int, llm) -> None:
        """After an engine step: its time split, the batch and the pools."""
        L = self.labels
        engine = llm.engine
        self.steps.labels(**L).inc()
        self.step_time.labels(**L).inc(seconds)
        draft_s, target_s = engine.times.draft_s, engine.times.target_s
        self.draft_time.labels(**L).inc(max(draft_s - self._times[0], 0.0))
        self.verify_time.labels(**L).inc(max(target_s - self._times[1], 0.0))
        self._times = (draft_s, target_s)
        preempted = engine.scheduler.num_preemptions
        self.preemptions.labels(**L).inc(preempted - self._preempted)
        self._preempted = preempted
        cache = engine.prefix_cache
        if cache is not None:
            self.prefix_queries.labels(**L).inc(cache.queries - self._prefix[0])
            self.prefix_hits.labels(**L).inc(cache.hits - self._prefix[1])
            self._prefix = (cache.queries, cache.hits)
        if batch:
            self.batch.labels(**L).observe(batch)
        self.k_in_use.labels(**L).set(engine.load.last_k if engine.load is not None else engine.k)
        self.gauges(llm)
        with self.lock:
            self.recent.append((time.time(), 0, 0, 0, 0, 0, batch))

    def gauges(self, llm) -> None:
        """Requests running and waiting, and the target's KV pool in use: after each step, and
        after a call ends (an aborted request leaves between steps)."""
        engine, L = llm.engine, self.labels
        self.running.labels(**L).set(len(engine.scheduler.running))
        self.waiting.labels(**L).set(len(engine.scheduler.waiting))
        cache = engine.target.cache
        self.kv_usage.labels(**L).set(1 - cache.allocator.num_free / cache.num_pages)

    def aborted(self, n: int) -> None:
        """Requests that ended unfinished (their client went away, or the server stopped)."""
        if n:
            self.success.labels(**self.labels, finished_reason="abort").inc(n)

    def engine_error(self, message: str) -> None:
        self.last_error = message

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def stats(self) -> dict:
        """The live page's figures over the last WINDOW_S seconds."""
        now = time.time()
        with self.lock:
            while self.recent and self.recent[0][0] < now - WINDOW_S:
                self.recent.popleft()
            rows = list(self.recent)
        drafts = sum(r[1] for r in rows)
        draft_tokens = sum(r[2] for r in rows)
        accepted = sum(r[3] for r in rows)
        by_position = [0] * self.k
        for r in rows:
            for i in range(min(r[4], self.k)):
                by_position[i] += 1
        tokens = sum(r[5] for r in rows)
        batches = [r[6] for r in rows if r[6]]
        span = max(now - rows[0][0], 1.0) if rows else WINDOW_S
        return {
            "model": self.model_name, "drafter": self.drafter, "k": self.k, "window_s": WINDOW_S,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "acceptance_by_position": [x / drafts if drafts else None for x in by_position],
            "tokens_per_s": tokens / span, "steps": len(batches),
            "mean_batch_size": sum(batches) / len(batches) if batches else 0.0,
            "kv_cache_usage": self.kv_usage.labels(**self.labels)._value.get(),
            "running": self.running.labels(**self.labels)._value.get(),
            "waiting": self.waiting.labels(**self.labels)._value.get(),
            "k_in_use": self.k_in_use.labels(**self.labels)._value.get(),
            "prefix_cache_hit_rate": self._prefix[1] / self._prefix[0] if self._prefix[0] else None,  # since start
            "last_error": self.last_error,
        }


def drafter_name(drafter) -> str:
    """What the live page calls the drafter."""
    names = {"EagleDrafter": "EAGLE-3 head", "ModelDrafter": "draft model", "NgramDrafter": "n-gram", "NoDrafter": "none"}
    if isinstance(drafter, LookupFirstDrafter):
        return f"prompt lookup, then the {drafter_name(drafter.model_drafter)}"
    if isinstance(drafter, TreeDrafter):
        return f"{drafter_name(drafter.head)}, trees of {drafter.budget} nodes"
    return names.get(type(drafter).__name__, type(drafter).__name__)
