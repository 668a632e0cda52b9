"""A request in flight, as the production engine keeps it: the core's sequence
(minispec/core/sequence.py: tokens, key, sampling parameters, block tables, status) and what its
extensions add: its sampling rule (pathwise), a drafter's per-sequence state, vLLM's stop rules
(min_tokens, ignore_eos, stop_token_ids, stop strings), its tokens' counts on the device for the
penalties, its text side (detokenizer state, where a stop string cuts the text: one attribute,
`text`, owned by detokenizer.py), its metrics and its logprobs.
"""

from __future__ import annotations

from ..core import sequence as core
from ..core.sequence import Status
from ..outputs import Logprob
from ..penalties import TokenCounts
from ..sampling import SamplingParams
from .detokenizer import Decoder, TextState, match_stop_strings
from .kv_cache import BlockTable
from .metrics import RequestMetrics

__all__ = ["Sequence", "Status"]


class Sequence(core.Sequence):
    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, page_size: int,
                 seed: int | None = None, eos_ids: list[int] = (), pathwise: bool = False,
                 table_type: type[BlockTable] = BlockTable):
        """seed: what its draws are keyed by (params.seed, else this, else drawn from torch's global
        generator, once); eos_ids: the model's end tokens (what min_tokens keeps from being sampled
        too early); pathwise: its sampling rule is Gumbel-max (pathwise.py; the engine decides);
        table_type: its block tables' class (a feature sharing pages brings its own)."""
        super().__init__(request_id, prompt_ids, params, page_size, seed, eos_ids, table_type)
        self.pathwise = pathwise
        # A drafter's own per-sequence data (the EAGLE drafter: pending target features); None on
        # arrival and again after a preemption, which frees the pages it describes (`preempted`).
        self.draft_state = None
        self.stop_reason: int | str | None = None  # the stop string that ended it (None for EOS)
        self.error: str | None = None  # the message, when finish_reason is "error" (see outputs.py)
        self.text: TextState | None = None  # the text side (detokenizer.py), made when first needed
        self.metrics = RequestMetrics()
        self.logprobs: list[dict[int, Logprob]] = []  # per output token, when params.logprobs is set
        # Its tokens' counts on the device, for its penalties and min_tokens (penalties.Penalties):
        # made by its first step with them, dropped when it finishes.
        self.token_counts: TokenCounts | None = None

    def penalty_row(self, drafts: list[int]) -> tuple:
        """What `penalties.penalize` needs for the position after `drafts` (drafts not yet accepted,
        in a speculative step): (params, prompt length, the tokens before it, the EOS ids)."""
        return self.params, len(self.prompt_ids), self.tokens + list(drafts), self.eos_ids

    def preempted(self) -> None:
        """The drafter starts over, as with a new sequence: its state described the freed pages,
        and the pages the sequence gets back (recomputed, or cached ones its admission finds, up
        to its newest token) are others."""
        self.draft_state = None

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
