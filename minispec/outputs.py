"""What a call returns, shaped field for field like vLLM's: one `RequestOutput` per prompt
(`generate`), holding its `CompletionOutput`s; per generated token, if asked, `Logprob`s. A
stream (`LLM.stream`, minispec's own) yields `StreamEvent`s as tokens are produced.

finish_reason is vLLM's: "stop" (EOS, a stop string or a stop token; `stop_reason` says which:
None for the tokenizer's EOS, the string, or the token id, also for generation_config.json's other
end tokens, as vLLM reports them), "length" (max_tokens or the context), "abort" (the
call was closed), and "error" (the request failed: `RequestOutput.error` says why).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .runtime.metrics import RequestMetrics


@dataclass
class Logprob:
    """A token's log-probability under the target's raw distribution (log_softmax of its logits,
    before temperature, top-k and top-p; vLLM's default), its rank there (1 = most likely) and
    its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # generated text, cut before a matched stop string (unless include_stop_str_in_output)
    token_ids: list[int]  # generated tokens (EOS / the token completing a stop string included)
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None  # per token: the top `logprobs` tokens and the sampled one
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the prompt text, when it was given as text
    prompt_token_ids: list[int]
    prompt_logprobs: None  # not computed by minispec (asking for them is refused)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics  # speculative-decoding counters and timings (runtime/metrics.py)
    error: str | None = None  # what went wrong, when a completion's finish_reason is "error"

    # Shortcuts to the first completion, which minispec's own code used before `outputs` held
    # CompletionOutputs; kept for one release.
    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's RequestOutput.num_cached_tokens)."""
        return self.metrics.num_cached_tokens

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs


@dataclass
class StreamEvent:
    """New tokens of request `index` (its position in the call's prompts). `new_text` is the text
    they complete: text that may still change (a partial UTF-8 character, a possible start of a
    stop string) is held back until it cannot, and a matched stop string is never sent (unless
    include_stop_str_in_output)."""

    index: int
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[dict[int, Logprob]] | None = None  # one per new token, if requested
    new_text: str = ""
    finish_reason: str | None = None  # set on the request's last event (see the module docstring)
    error: str | None = None
    stop_reason: int | str | None = None
    # The step behind these tokens: the drafter proposed `drafted`, the target accepted the first
    # `num_accepted`; so new_token_ids[:num_accepted] are accepted drafts and the token after them
    # is the target's own (the replacement of the first rejected draft, or the bonus token). EOS or
    # a stop string may cut new_token_ids short of num_accepted + 1.
    drafted: list[int] = dataclasses.field(default_factory=list)
    num_accepted: int = 0
    completion_index: int = 0  # which of the request's n completions (SamplingParams.n)
    metrics: RequestMetrics | None = None  # the request's counters and timings, on its last event
    num_drafted: int = 0  # positions the step drafted: len(drafted) for a chain; for a tree (whose
    # `drafted` shows the taken branch and the first rejected child) its depth, as RequestMetrics counts
