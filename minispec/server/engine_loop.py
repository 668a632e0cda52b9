"""ONE engine for every connection: a background thread steps the LLM whenever any request is
queued, and hands each call's StreamEvents to the asyncio queue of the handler that made it.

HTTP handlers only submit (which validates and queues, all or nothing), read their queue, and
cancel: a client that goes away closes its call, which aborts its requests and frees their pages.
Requests from concurrent clients therefore join the same continuous batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from ..llm import LLM
from .metrics import ServerMetrics


@dataclass
class Handle:
    """One HTTP request's call: its events arrive on `queue`, None after the last."""

    call: object
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    last_event: dict = field(default_factory=dict)  # (index, completion) -> perf_counter of its previous event


class EngineLoop:
    def __init__(self, llm: LLM, metrics: ServerMetrics):
        self.llm, self.metrics = llm, metrics
        self.handles: list[Handle] = []
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
            handles, self.handles = list(self.handles), []
        for handle in handles:
            self.finish(handle, error=message)

    def submit(self, prompts, params) -> Handle:
        """Queue a request (raises ValueError / TypeError on bad input, before anything is queued)."""
        loop = asyncio.get_running_loop()
        call = self.llm.submit(prompts, params)
        handle = Handle(call, asyncio.Queue(), loop)
        with self.wake:
            self.handles.append(handle)
            self.wake.notify()
        self.metrics.prompt_tokens(sum(len(s.prompt_ids) for s in call.seqs))
        return handle

    def cancel(self, handle: Handle) -> None:
        """The client is gone (or the handler ended early): its requests leave the engine."""
        with self.wake:
            if handle in self.handles:
                self.handles.remove(handle)
        self.llm.close(handle.call)

    def finish(self, handle: Handle, error: str | None = None) -> None:
        if handle in self.handles:
            self.handles.remove(handle)
        self.llm.close(handle.call)
        if error is not None:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, {"error": error})
        handle.loop.call_soon_threadsafe(handle.queue.put_nowait, None)

    def run(self) -> None:
        while True:
            with self.wake:
                while not self.stopping and not self.handles:
                    self.wake.wait()
                if self.stopping:
                    return
            start = time.perf_counter()
            try:
                stepped = self.llm.step_once()
            except BaseException as e:  # noqa: BLE001 - the LLM already failed every request in flight
                self.metrics.engine_error(f"{type(e).__name__}: {e}")
                stepped = True
            self.deliver(time.perf_counter() - start if stepped else 0.0)
            if not stepped:
                time.sleep(0.001)

    def deliver(self, step_s: float) -> None:
        """Move each call's new events to its handler; finished calls are closed."""
        now = time.perf_counter()
        batch = len(self.llm.engine.scheduler.running)
        with self.llm._lock:
            for handle in list(self.handles):
                events = list(handle.call.events)
                handle.call.events.clear()
                for event in events:
                    key = (event.index, event.completion_index)
                    self.metrics.event(event, now - handle.last_event.get(key, handle.arrival))
                    handle.last_event[key] = now
                    handle.loop.call_soon_threadsafe(handle.queue.put_nowait, event)
                if all(s.finished for s in handle.call.seqs) and not handle.call.events:
                    self.finish(handle)
        if step_s:
            self.metrics.step(step_s, batch, self.llm)
