"""What bounds the server's work: the slots of sequences in flight and the body's deadline."""

from __future__ import annotations

import threading

BODY_TIMEOUT_S = 30.0  # a request body must arrive within this; no slot is held while it does


class Slots:
    """Sequences in flight: a request holds one per prompt and completion (prompts x n), from its
    parsed body to its end, so one request cannot queue more than the server takes at once."""

    def __init__(self, limit: int):
        self.limit, self.used, self.lock = limit, 0, threading.Lock()

    def take(self, k: int) -> bool:
        with self.lock:
            if self.used + k > self.limit:
                return False
            self.used += k
            return True

    def give(self, k: int) -> None:
        with self.lock:
            self.used -= k


def once(fn):
    """fn, callable from any thread, that runs at most once."""
    lock, done = threading.Lock(), []

    def call() -> None:
        with lock:
            if done:
                return
            done.append(True)
        fn()

    return call
