"""A request in flight: its tokens, the key of its random draws (randomness.py) and its sampling
rule, its KV block tables in the target's and the draft's pools, its stop conditions, and its
speculative-decoding counters. Its text side (detokenizer state, where a stop string cuts the
text) is one attribute, `text`, owned by detokenizer.py.
"""

from __future__ import annotations

import enum

import torch

from ..outputs import Logprob
from ..randomness import request_key
from ..sampling import SamplingParams
from .detokenizer import Decoder, TextState, match_stop_strings
from .kv_cache import BlockTable
from .metrics import RequestMetrics


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, page_size: int,
                 seed: int | None = None, eos_ids: list[int] = (), pathwise: bool = False,
                 table_type: type[BlockTable] = BlockTable):
        """seed: what its draws are keyed by (params.seed, else this, else drawn from torch's global
        generator, once); eos_ids: the model's end tokens (what min_tokens keeps from being sampled
        too early); pathwise: its sampling rule is Gumbel-max (pathwise.py; the engine decides);
        table_type: its block tables' class (a feature sharing pages brings its own)."""
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
        self.pathwise = pathwise
        self.target_table = table_type(page_size)  # K/V of this sequence in the target's pool
        self.draft_table = table_type(page_size)  # ... and in the draft model's (or EAGLE head's) pool
        # A drafter's own per-sequence data (the EAGLE drafter: pending target features); None on
        # arrival and again after a preemption, which frees the pages it describes (scheduler.py).
        self.draft_state = None
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (vLLM's, see outputs.py)
        self.stop_reason: int | str | None = None  # the stop string that ended it (None for EOS)
        self.error: str | None = None  # the message, when finish_reason is "error"
        self.text: TextState | None = None  # the text side (detokenizer.py), made when first needed
        self.num_preemptions = 0
        self.metrics = RequestMetrics()
        self.logprobs: list[dict[int, Logprob]] = []  # per output token, when params.logprobs is set

    def table(self, which: str) -> BlockTable:
        """This sequence's block table in the "target" or the "draft" pool."""
        return self.target_table if which == "target" else self.draft_table

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def penalty_row(self, drafts: list[int]) -> tuple:
        """What `sampling.penalize` needs for the position after `drafts` (drafts not yet accepted,
        in a speculative step): (params, prompt length, the tokens before it, the EOS ids)."""
        return self.params, len(self.prompt_ids), self.tokens + list(drafts), self.eos_ids

    @property
    def remaining(self) -> int:
        """How many more tokens this request may emit."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, eos_ids: list[int], tokenizer: Decoder) -> bool:
        """Add one generated token and check stop conditions (none before min_tokens: vLLM's
        rule). Returns True when the request is done. eos_ids: the model's end tokens, the EOS first.

        tokenizer: what renders the output's text, for stop-string matching."""
        self.output_ids.append(token)
        p = self.params
        if token in eos_ids and not p.ignore_eos:  # (min_tokens keeps EOS and stop tokens from being sampled early)
            self.finish_reason = "stop"  # stop_reason None: the EOS (eos_ids[0]); another end id is reported
            self.stop_reason = None if token == eos_ids[0] else token  # as a stop token, as vLLM reports generation_config's
        elif token in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif p.stop and len(self.output_ids) > p.min_tokens:
            match_stop_strings(self, tokenizer)  # (the stop token's text is left out: detokenizer.py)
        if self.finish_reason is None and self.remaining == 0:
            self.finish_reason = "length"
        return self.finish_reason is not None
