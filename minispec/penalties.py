"""vLLM's penalties and min_tokens: one formula, on the host from token lists and on the device
from counts kept there.

Repetition, presence and frequency penalties and min_tokens adjust a row's logits before the warp
(core/sampling.py), from the tokens before the row's position. `penalty_logits` is the arithmetic;
`penalize` feeds it from token lists on the host (the reference, and what a draft model's host
proposal uses); `Penalties` feeds it from each sequence's `TokenCounts`, kept on the device and
grown by the tokens each step's upload carries, so a step laid out for the device penalises its
rows without a host copy. Both are deterministic functions of a row's history, so a draft and the
target that apply them to the same history keep speculative sampling exact: the output law is the
penalised target's. verification_options.py applies them to a step's verification rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams


def penalize(logits: torch.Tensor, rows: list[tuple[SamplingParams, int, list[int], list[int]]]) -> torch.Tensor:
    """vLLM's logit adjustments, row by row, before the warp. logits [N, V]; rows[i] = (params,
    prompt length, the tokens before row i's position: prompt, output, and in a speculative step
    the drafts before it; the request's EOS ids). Row i's output so far is tokens[prompt length:].
    Returns a new tensor (the input when no row adjusts anything).

        repetition: l / r where l > 0, l * r otherwise, for tokens in prompt or output
        presence, frequency: l - presence * [count > 0] - frequency * count, counts over the output
        min_tokens: EOS (even with ignore_eos, as in vLLM) and stop_token_ids at -inf while the
                    output is shorter than min_tokens

    A deterministic function of the row's history, so a draft and the target that apply it to the
    same history keep speculative sampling exact (the output law is the penalised target's). The
    host's way in: the histories become the tensors of `penalty_logits`, which a step laid out for
    the device (`Penalties`) feeds from its device-resident counts instead."""
    if not any(p.adjusts_logits for p, _, _, _ in rows):
        return logits
    N, V, device = logits.shape[0], logits.shape[-1], logits.device
    counts = torch.zeros(N, V, device=device)  # [N, V] fp32: each token's count in the row's output
    seen = torch.zeros(N, V, dtype=torch.bool, device=device)  # [N, V]: in the prompt or the output
    banned = torch.zeros(N, V, dtype=torch.bool, device=device)  # [N, V]: what min_tokens bans
    values = []
    for i, (p, prompt_len, tokens, eos_ids) in enumerate(rows):
        values.append(penalty_values(p))
        if not p.adjusts_logits:
            continue
        ids = torch.tensor([t for t in tokens if t < V], dtype=torch.int64, device=device)  # [n]
        seen[i, ids] = True
        output = torch.tensor([t for t in tokens[prompt_len:] if t < V], dtype=torch.int64, device=device)
        counts[i] = torch.bincount(output, minlength=V).float()
        if len(tokens) - prompt_len < p.min_tokens:
            banned[i, [t for t in stop_ids(p, eos_ids) if t < V]] = True
    repetition, presence, frequency = torch.tensor(values, device=device).float().unbind(-1)  # [N]
    return penalty_logits(logits, counts, seen, repetition, presence, frequency, banned)


def penalty_values(p: SamplingParams) -> tuple[float, float, float]:
    """(repetition, presence, frequency): every penalty's factor, 1, 0, 0 where it is off."""
    return p.repetition_penalty, p.presence_penalty, p.frequency_penalty


def stop_ids(p: SamplingParams, eos_ids: list[int]) -> list[int]:
    """The tokens min_tokens keeps from being sampled: the EOS ids (even with ignore_eos, as in
    vLLM) and stop_token_ids."""
    return list(eos_ids) + list(p.stop_token_ids)


def penalty_logits(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                   repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                   banned: torch.Tensor) -> torch.Tensor:
    """The penalties' arithmetic, one formula for the host's `penalize` and the device's
    `Penalties`: logits [N, V]; counts [N, V] fp32 each token's count in the row's output; seen
    [N, V] bool in the prompt or the output; repetition, presence, frequency [N] fp32; banned [N, V]
    bool the stop tokens to mask. A row with every penalty off (1, 0, 0) and nothing banned comes
    back unchanged bit for bit (l / 1, l * 1 and l - 0 are l), so a batch is penalised whole."""
    repetition = repetition[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)  # [N, V]
    out = torch.where(seen, repeated, logits)
    out = out - (frequency[:, None] * counts + presence[:, None] * (counts > 0))
    return out.masked_fill(banned, float("-inf"))


@dataclass
class TokenCounts:
    """One sequence's token history on the device, what its penalties read: output [V] fp32, each
    token's count in its output; seen [V] bool, whether it is in its prompt or output; counted,
    how many of its tokens (prompt then output) are in them."""

    output: torch.Tensor
    seen: torch.Tensor
    counted: int = 0


class Penalties:
    """A step's penalties and min_tokens on the device, for a batch of B sequences.

    Where the counts live. Each sequence with penalties keeps its own `TokenCounts` on the device
    (`Sequence.token_counts`), and a step uploads only the tokens it has gained since (its prompt
    on its first step, then the one to k+1 tokens the last step emitted) and adds them there
    (`stage`, then `count`). So one upload a step stays one, and small; the memory is V * 5 bytes
    (fp32 counts, bool seen) per running sequence with penalties, none for the others, freed when
    it finishes; a preemption, which frees pages and keeps tokens, leaves it right. (Uploading
    whole histories would cost host time proportional to every context each step; a pool indexed
    by slots would need slots kept in step with the scheduler's, which the step does not own.)

    Device tensors, one row per sequence b (neutral rows, which change nothing, for those
    without): output [B, V], seen [B, V], repetition / presence / frequency [B] fp32, min_left [B]
    int64 (min_tokens - len(output): row j of a step is masked while j < min_left, j the drafts
    before it) and banned [B, V] bool, the stop tokens."""

    def __init__(self, seqs: list, sent: dict[str, torch.Tensor], vocab_size: int):
        """From the upload (`stage`) and each sequence's `TokenCounts` (already `count`ed)."""
        device = sent["penalty.values"].device
        zeros = torch.zeros(vocab_size, device=device)  # [V]: the rows of sequences without any
        unseen = zeros.bool()
        counted = [s.token_counts if s.params.adjusts_logits else None for s in seqs]
        self.output = torch.stack([zeros if c is None else c.output for c in counted])  # [B, V]
        self.seen = torch.stack([unseen if c is None else c.seen for c in counted])  # [B, V]
        factors = sent["penalty.values"].float()  # [B, 3]
        self.repetition, self.presence, self.frequency = factors.unbind(-1)  # [B] each
        self.min_left = sent["penalty.min_left"]  # [B]
        stop = sent["penalty.stop"]  # [B, S], padded with V
        banned = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.bool, device=device)  # [B, V+1]
        self.banned = banned.scatter_(1, stop, True)[:, :vocab_size]  # [B, V] (the padding dropped)

    @staticmethod
    def stage(upload, seqs: list, vocab_size: int) -> list[tuple[int, int, int, int]] | None:
        """Lay the step's penalties out in `upload` (`Upload`, runtime/transfers.py): each
        sequence's factors [B, 3] fp64, min_left [B], stop tokens [B, S], and the tokens each
        sequence with penalties gained since its last step (all, new [N]; its output's, new_output
        [M]). Returns each sequence's slices of new and new_output (for `from_upload`), or None
        (nothing staged) when no request adjusts its logits."""
        if not any(s.params.adjusts_logits for s in seqs):
            return None
        values, min_left, stops, new, new_output, slices = [], [], [], [], [], []
        for s in seqs:
            p, adjusts = s.params, s.params.adjusts_logits
            values.append(penalty_values(p))
            min_left.append(p.min_tokens - len(s.output_ids) if adjusts else 0)
            stops.append([t for t in stop_ids(p, s.eos_ids) if t < vocab_size] if adjusts else [])
            counted = s.token_counts.counted if adjusts and s.token_counts is not None else 0
            if counted > len(s):  # (tokens taken back: count again from the start)
                s.token_counts, counted = None, 0
            # (from prompt_ids and output_ids, not s.tokens: that would copy the whole history)
            outputs = s.output_ids[max(counted - len(s.prompt_ids), 0) :] if adjusts else []
            outputs = [t for t in outputs if t < vocab_size]
            prompt = [t for t in s.prompt_ids[counted:] if t < vocab_size] if adjusts else []
            gained = prompt + outputs
            slices.append((len(new), len(new) + len(gained),
                           len(new_output), len(new_output) + len(outputs)))
            new += gained
            new_output += outputs
        width = max(map(len, stops), default=0) or 1
        upload.add("penalty.values", values, torch.float64)  # [B, 3]
        upload.add("penalty.min_left", min_left)  # [B]
        upload.add("penalty.stop", [t + [vocab_size] * (width - len(t)) for t in stops])  # [B, S]
        upload.add("penalty.new", new)  # [N]
        upload.add("penalty.new_output", new_output)  # [M]
        return slices

    @classmethod
    def from_upload(cls, seqs: list, sent: dict[str, torch.Tensor], slices: list[tuple[int, int, int, int]] | None,
                    vocab_size: int) -> Penalties | None:
        """The step's penalties once its upload is sent: each sequence's counts brought up to date
        with the tokens the upload carried (`count`) before anything reads them; None where `stage`
        staged nothing."""
        if slices is None:
            return None
        cls.count(seqs, sent, slices, vocab_size)
        return cls(seqs, sent, vocab_size)

    @staticmethod
    def count(seqs: list, sent: dict[str, torch.Tensor], slices: list[tuple[int, int, int, int]],
              vocab_size: int) -> None:
        """Add the uploaded new tokens to each sequence's `TokenCounts` (made, zero, on its first
        step), on the device; they then count every token the sequence has."""
        new, new_output = sent["penalty.new"], sent["penalty.new_output"]
        for s, (a, b, c, d) in zip(seqs, slices):
            if not s.params.adjusts_logits:
                continue
            device = new.device
            if s.token_counts is None:
                counts = torch.zeros(vocab_size, device=device)  # [V]
                s.token_counts = TokenCounts(counts, torch.zeros_like(counts, dtype=torch.bool))
            s.token_counts.seen.index_fill_(0, new[a:b], True)
            s.token_counts.output.index_add_(0, new_output[c:d], torch.ones(d - c, device=device))
            s.token_counts.counted = len(s)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, drafted: torch.Tensor | None,
              depth: torch.Tensor) -> torch.Tensor:
        """logits [N, V] penalised: row i is sequence rows[i]'s with drafted[i] [V] fp32 (the counts
        of the drafts before it; None: none) and depth[i] drafts before it."""
        counts, seen = self.output[rows], self.seen[rows]  # [N, V]
        if drafted is not None:
            counts, seen = counts + drafted, seen | (drafted > 0)
        banned = self.banned[rows] & (depth < self.min_left[rows])[:, None]  # [N, V]
        return penalty_logits(logits, counts, seen, self.repetition[rows], self.presence[rows],
                              self.frequency[rows], banned)
