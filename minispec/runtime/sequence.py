"""A request in flight: its tokens, the key of its random draws (randomness.py) and its sampling
rule, its KV block tables in the target's and the draft's pools, its stop conditions, and its
speculative-decoding counters.
"""

from __future__ import annotations

import enum

import torch

from ..outputs import Logprob
from ..randomness import request_key
from ..sampling import SamplingParams
from .detokenizer import Decoder, IncrementalDetokenizer
from .kv_cache import BlockTable
from .metrics import RequestMetrics


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, page_size: int,
                 seed: int | None = None, eos_ids: list[int] = (), pathwise: bool = False):
        """seed: what its draws are keyed by (params.seed, else this, else drawn from torch's global
        generator, once); eos_ids: the model's end tokens (what min_tokens keeps from being sampled
        too early); pathwise: its sampling rule is Gumbel-max (pathwise.py; the engine decides)."""
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
        self.target_table = BlockTable(page_size)  # K/V of this sequence in the target's pool
        self.draft_table = BlockTable(page_size)  # ... and in the draft model's (or EAGLE head's) pool
        # A drafter's own per-sequence data (the EAGLE drafter: pending target features); None on
        # arrival and again after a preemption, which frees the pages it describes (scheduler.py).
        self.draft_state = None
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (vLLM's, see outputs.py)
        self.stop_reason: int | str | None = None  # the stop string that ended it (None for EOS)
        self.error: str | None = None  # the message, when finish_reason is "error"
        self.stop_text_end: int | None = None  # output text is cut here when a stop string matched
        self.text_ids_end: int | None = None  # the text leaves out the last token (an EOS or stop token) when set
        self.detokenizer = IncrementalDetokenizer()  # the output's text so far
        self.stop_floor: int | None = None  # characters of the first min_tokens tokens' text (stop strings end past it)
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
            self.match_stop_strings(tokenizer)
        if self.finish_reason == "stop" and self.stop_text_end is None and not p.include_stop_str_in_output:
            self.text_ids_end = len(self.output_ids) - 1  # vLLM leaves the stop token's text out
        if self.finish_reason is None and self.remaining == 0:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def text(self, tokenizer: Decoder) -> str:
        """The output's text so far, decoded incrementally (detokenizer.py): what the output ids add
        after the prompt, less the last token's text when an EOS or a stop token ended the request."""
        ids = self.output_ids if self.text_ids_end is None else self.output_ids[: self.text_ids_end]
        return self.detokenizer.text(tokenizer, self.prompt_ids, ids)

    def match_stop_strings(self, tokenizer: Decoder) -> None:
        """The earliest stop string in the output text that ends past the text of the first
        min_tokens tokens (vLLM's rule) ends the request; its text ends before the string, or after
        it with include_stop_str_in_output."""
        p = self.params
        text = self.text(tokenizer)
        if self.stop_floor is None:  # (called once the output is longer than min_tokens)
            self.stop_floor = len(tokenizer.decode_after(self.prompt_ids, self.output_ids[: p.min_tokens])) if p.min_tokens else 0
        floor = self.stop_floor
        hits = [(i, s) for i, s in ((text.find(s, max(0, floor - len(s) + 1)), s) for s in p.stop) if i >= 0]
        if hits:
            i, stop = min(hits)
            self.stop_text_end = i + len(stop) if p.include_stop_str_in_output else i
            self.finish_reason, self.stop_reason = "stop", stop
