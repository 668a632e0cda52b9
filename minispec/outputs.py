"""What a call returns: one RequestOutput per prompt (`generate`), StreamEvents as tokens are
produced (`stream`). Field names follow vLLM's where minispec has the same information."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .runtime.metrics import RequestMetrics


@dataclass
class RequestOutput:
    index: int  # position in the prompts list
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (EOS / the token completing a stop string included)
    text: str  # generated text, cut before a matched stop string
    finish_reason: str  # "length" | "eos" | "stop" | "abort" | "error"
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: log-prob}, if requested
    prompt: str | None = None  # the prompt text, when it was given as text
    error: str | None = None  # what went wrong, when finish_reason is "error"

    @property
    def outputs(self) -> list["RequestOutput"]:
        """vLLM's shape: `output.outputs[0].text` (one completion per prompt here)."""
        return [self]


@dataclass
class StreamEvent:
    """New tokens of request `index` (its position in the call's prompts). `new_text` is the text
    they complete: text that may still change (a partial UTF-8 character, a possible start of a
    stop string) is held back until it cannot, and a matched stop string is never sent."""

    index: int
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, if requested
    new_text: str = ""
    finish_reason: str | None = None  # set on the request's last event (see RequestOutput)
    error: str | None = None
    # The step behind these tokens: the drafter proposed `drafted`, the target accepted the first
    # `num_accepted`; so new_token_ids[:num_accepted] are accepted drafts and the token after them
    # is the target's own (the replacement of the first rejected draft, or the bonus token). EOS or
    # a stop string may cut new_token_ids short of num_accepted + 1.
    drafted: list[int] = dataclasses.field(default_factory=list)
    num_accepted: int = 0
