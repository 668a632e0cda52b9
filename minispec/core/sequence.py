"""A request in flight: its tokens, the key of its random draws, its sampling parameters, its KV
block tables in the target's and the draft's pools, and why it stopped.

`params` is read, never written: max_tokens, seed, temperature, top_k, top_p (any object with
those attributes). A request stops at one of the model's end tokens ("stop") or once it has
emitted max_tokens ("length"); richer stop rules plug in by overriding `append`.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from .kv_cache import BlockTable
from .randomness import request_key


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: int, prompt_ids: list[int], params: Any, page_size: int,
                 seed: int | None = None, eos_ids: list[int] = (),
                 table_type: type[BlockTable] = BlockTable):
        """seed: what its draws are keyed by (params.seed, else this, else drawn from torch's
        global generator, once); eos_ids: the model's end tokens; table_type: its block tables'
        class (an extension sharing pages brings its own)."""
        self.eos_ids = list(eos_ids)
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.seed = seed
        self.key = request_key(seed)  # every random number it uses is keyed by this and a position
        self.target_table = table_type(page_size)  # K/V of this sequence in the target's pool
        self.draft_table = table_type(page_size)  # ... and in the drafter's pool, if it has one
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" (vLLM's names)
        self.num_preemptions = 0

    def table(self, which: str) -> BlockTable:
        """This sequence's block table in the "target" or the "draft" pool."""
        return self.target_table if which == "target" else self.draft_table

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """How many more tokens this request may emit."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int) -> bool:
        """Add one generated token; True when the request is done (an end token, or max_tokens)."""
        self.output_ids.append(token)
        if token in self.eos_ids:
            self.finish_reason = "stop"
        elif self.remaining == 0:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def preempted(self) -> None:
        """Called by the scheduler once it has freed this sequence's pages to preempt it (its
        tokens are kept and recomputed on readmission). An override drops whatever it kept that
        described those pages."""
