"""ONE engine for every connection: a background thread steps the LLM whenever any request is
queued, and hands each call's StreamEvents to the asyncio queue of the handler that made it.

HTTP handlers only submit (which validates and queues, all or nothing: run in a worker thread,
since it waits for the engine's lock), read their queue, and cancel (which only marks the call:
the engine thread closes it, aborting its requests and freeing their pages). Requests from
concurrent clients therefore join the same continuous batch, and the event loop never waits for
an engine step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..llm import LLM
from .metrics import ServerMetrics

T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T]) -> T:
    """fn() run in a thread of its own that ends when fn returns; its result, or its exception.

    For loading the model a server will step on its engine thread. torch's CPU ops run their
    parallel regions on OpenMP (libgomp), which keeps a pool of worker threads for every thread
    that ever ran one, as long as that thread lives. A model loaded on the main thread (conversion,
    prepacking, matmul timing) and stepped on the engine thread leaves two pools: more OpenMP
    threads than cores, where libgomp's workers spin only briefly before they sleep, so every
    parallel op waits for its workers to be woken. A thread that ends frees its pool; the engine
    thread's is then the only one.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="minispec-load", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)  # (in slices, so that Ctrl-C reaches the main thread on every platform)
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass
class Handle:
    """One HTTP request's call: its events arrive on `queue`, then None after the last."""

    call: object
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    release: Callable[[], None]  # frees the request's concurrency slot (called once, when it ends)
    arrival: float = field(default_factory=time.perf_counter)
    last_event: dict = field(default_factory=dict)  # (index, completion) -> perf_counter of its previous event
    ended: bool = False

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    def __init__(self, llm: LLM, metrics: ServerMetrics):
        self.llm, self.metrics = llm, metrics
        self.handles: list[Handle] = []  # changed only under `wake`
        self.cancelled: list[Handle] = []
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="minispec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, message: str = "the server is shutting down") -> None:
        """Stop stepping; every call still in flight gets a final error event (once)."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)
        with self.wake:  # (taken whole: a second stop() finds none, so no call is told twice)
            handles, self.handles = self.handles + self.cancelled, []
            self.cancelled = []
        for handle in handles:
            self.end(handle, error=message)

    def submit(self, prompts, params, loop: asyncio.AbstractEventLoop, release: Callable[[], None]) -> Handle:
        """Queue a request (raises on bad input, before anything is queued). From a worker thread."""
        call = self.llm.submit(prompts, params)
        handle = Handle(call, asyncio.Queue(), loop, release)
        with self.wake:
            if self.stopping:
                self.llm.close(call)
                raise RuntimeError("the server is shutting down")
            self.handles.append(handle)
            self.wake.notify()
        self.metrics.prompt_tokens(sum(len(s.prompt_ids) for s in call.seqs))
        return handle

    def cancel(self, handle: Handle) -> None:
        """The client is gone (or the handler ended early): the engine thread closes the call."""
        with self.wake:
            if handle in self.handles:
                self.handles.remove(handle)
                self.cancelled.append(handle)
                self.wake.notify()

    def end(self, handle: Handle, error: str | None = None) -> None:
        """Close the call (its unfinished requests are aborted, pages freed), tell its handler."""
        if handle.ended:
            return
        handle.ended = True
        aborted = sum(not s.finished for s in handle.call.seqs)
        self.llm.close(handle.call)
        self.metrics.aborted(aborted)
        self.metrics.gauges(self.llm)
        if error is not None:
            handle.put({"error": error})
        handle.put(None)
        handle.release()

    def run(self) -> None:
        while True:
            with self.wake:
                while not self.stopping and not self.handles and not self.cancelled:
                    self.wake.wait()
                if self.stopping:
                    return
                cancelled, self.cancelled = self.cancelled, []
            for handle in cancelled:
                self.end(handle)
            start = time.perf_counter()
            try:
                stepped = self.llm.step_once()
            except BaseException as e:  # noqa: BLE001 - the LLM already failed every request in flight
                self.metrics.engine_error(f"{type(e).__name__}: {e}")
                stepped = 0
            try:
                self.deliver(time.perf_counter() - start, stepped)
            except Exception as e:  # noqa: BLE001 - a handler's bookkeeping must never stop the engine
                self.metrics.engine_error(f"delivering events: {type(e).__name__}: {e}")
            if not stepped:
                time.sleep(0.001)

    def deliver(self, step_s: float, batch: int) -> None:
        """Move each call's new events to its handler; finished calls are ended."""
        now = time.perf_counter()
        with self.wake:
            handles = list(self.handles)
        finished = []
        for handle in handles:
            events, done = self.llm.drain(handle.call)
            for event in events:
                key = (event.index, event.completion_index)
                previous = handle.last_event.get(key)  # (the first token's wait is TTFT, not ITL)
                self.metrics.event(event, None if previous is None else now - previous)
                handle.last_event[key] = now
                handle.put(event)
            if done:
                finished.append(handle)
        with self.wake:
            for handle in finished:
                if handle in self.handles:
                    self.handles.remove(handle)
        for handle in finished:
            self.end(handle)
        if batch:
            self.metrics.step(step_s, batch, self.llm)
