"""Speculative decoding: one step, top to bottom (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

For every running sequence whose last token is x_L:
  1. Draft. The drafter proposes n <= k tokens d_1..d_n with draft distributions
     draft_probs_i = q_i(.) (a model drafter samples d_i ~ q_i; the n-gram drafter's q_i is one-hot).
  2. Verify. The target scores all n+1 positions in ONE forward pass over [x_L, d_1, .., d_n],
     giving target_probs_i = p_i(.) for i = 1..n+1 (p_{n+1} is the distribution after d_n).
  3. Accept / reject. Token d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), left
     to right, until the first rejection. At a rejection at position i, the recovered token is
     sampled from the residual norm(max(0, p_i - q_i)); if all n are accepted, a bonus token is
     sampled from p_{n+1}. Either way every step emits num_accepted + 1 tokens, and each token
     is distributed exactly as the target alone would have sampled it.
  4. Roll back. The target cached K/V for [x_L, d_1..d_n]; positions past the accepted drafts
     are truncated (no copy). The drafter truncates its own cache the same way.

`speculative_step` is these four steps; the rule of step 3 follows it (`rejection_sample`), then
greedy verification. p and q are both warped by `warp_probs` with the request's options.
Temperature 0 makes both one-hot, and the rule becomes greedy verification: accept while
d_i == argmax p_i, then emit argmax p at the first mismatch. Plain decoding is this step with the
no-op drafter (n = 0): the target samples one token from p_1.

Randomness: every number a request uses is keyed by its seed and the position of the token it
decides (randomness.py): the drafter's samples, the acceptance tests and the final token's draw.
So a seeded request emits the same tokens whatever else is in the batch, as long as the drafter
and k are the same (another drafter or k drafts other tokens, which steer which token is
emitted, never its law).

Why it is exact (one position): the emitted token x has probability
q(x) min(1, p(x)/q(x)) + P(reject) r(x) = min(p, q)(x) + (p - q)^+(x) = p(x), since
P(reject) = sum (q - p)^+ = sum (p - q)^+ is the mass that normalises r. tests/test_speculative_exact.py
checks this on the functions below; tests/test_core_engine.py and test_speculative_statistical.py
on whole engines.

Notation: we never write bare p/q in code; `target_probs` and `draft_probs` name them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters import Drafter
from .randomness import Purpose, uniform
from .runner import Feed, ModelRunner
from .sampling import finite_rows, sample, warp_probs
from .sequence import Sequence


@dataclass
class StepResult:
    """What one step did for one sequence: drafted, the draft tokens it verified; num_accepted,
    how many of them the target accepted (its emitted tokens begin with them); num_drafted, the
    positions drafted (len(drafted) for a chain)."""

    drafted: list[int]
    num_accepted: int
    num_drafted: int


def speculative_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, k: int) -> list[StepResult]:
    """Advance every sequence by one draft-verify-accept step; each emits 1..n+1 tokens, fewer if
    it finishes (EOS, max_tokens). Precondition: seq.target_table.num_cached <= len(seq) - 1."""
    # 1. Draft: never more than the request may still emit (the final token comes free).
    proposal = drafter.propose(seqs, [min(k, s.remaining - 1) for s in seqs])
    # 2. Verify: ONE target forward feeds each sequence its uncached tokens plus its drafts and
    # scores the last n+1 positions.
    feeds = [Feed(s.target_table, s.tokens[s.target_table.num_cached :] + d, len(d) + 1)
             for s, d in zip(seqs, proposal.tokens)]
    logits = target.forward(feeds)  # [sum(n_b + 1), V]
    bad = (~finite_rows(logits)).nonzero().flatten().tolist()
    if bad:
        raise RuntimeError(f"the target's logits are not finite (NaN or inf) in verification rows {bad}")
    # 3. Accept / reject.
    if all(s.params.greedy for s in seqs):
        tokens, num_accepted = greedy_verify(logits, proposal.tokens)
    else:
        params = [s.params for s, d in zip(seqs, proposal.tokens) for _ in range(len(d) + 1)]
        tokens, num_accepted = standard_verify(warp_probs(logits, params), seqs, proposal.tokens, proposal.probs)
    for s, emitted, n in zip(seqs, tokens, num_accepted):
        for token in emitted[: n + 1]:
            if s.append(token):
                break
    # 4. Roll back: keep the K/V of the accepted tokens (the newest one is fed next step).
    for s in seqs:
        s.target_table.truncate(len(s) - 1, target.cache.allocator)
    drafter.rollback(seqs)
    return [StepResult(d, n, len(d)) for d, n in zip(proposal.tokens, num_accepted)]


def accept_probability(target_prob: torch.Tensor, draft_prob: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) elementwise. A drafter proposes only tokens with q(d) > 0; should q(d)
    be 0 anyway (rounding), d is accepted iff p(d) > 0, so a token the target can never emit is
    never accepted."""
    ratio = (target_prob / draft_prob.clamp(min=torch.finfo(draft_prob.dtype).tiny)).clamp(max=1.0)
    return torch.where(draft_prob > 0, ratio, (target_prob > 0).to(ratio.dtype))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis: where the target puts more mass than the draft.

    With q = 0 (no draft at this position) this is p itself, which is how the bonus token is
    drawn by the same code. If p <= q everywhere (p == q up to rounding), rejection has
    probability zero; we then return p so the result stays a distribution."""
    residual = (target_probs - draft_probs).clamp(min=0)  # [..., V]
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs)


def rejection_sample(draft_tokens: torch.Tensor, num_draft: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, accept_u: torch.Tensor, token_u: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept/reject rule for a batch of sequences with different draft lengths.

    draft_tokens: [B, K] int64 (rows padded past num_draft[b]); num_draft: [B] int64 (<= K)
    draft_probs:  [B, K+1, V], q at each drafted position, ZERO rows at positions >= num_draft[b]
    target_probs: [B, K+1, V], p at each of the K+1 verified positions
    accept_u:     [B, K] fp64, the uniform that tests draft i; token_u: [B, K+1] fp64, the uniform
                  that draws the final token should the step end at position i (randomness.py)
    Returns (tokens [B, K+1], num_accepted [B]): row b emits tokens[b, :num_accepted[b] + 1]."""
    B, K = draft_tokens.shape
    device = target_probs.device
    rows = torch.arange(B, device=device)
    drafted = torch.arange(K, device=device)[None, :] < num_draft[:, None]  # [B, K]

    # 3a. Accept d_i when u_i < min(1, p_i(d_i) / q_i(d_i)).
    target_prob = target_probs[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    draft_prob = draft_probs[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    accepted = (accept_u.to(device) < accept_probability(target_prob, draft_prob)) & drafted  # [B, K]
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B] length of the leading accepted run

    # 3b. One more token at position num_accepted: from the residual after a rejection, or the
    # bonus from p_{n+1} (whose draft row is zero, so the residual is p itself).
    final_dist = residual_distribution(target_probs[rows, num_accepted], draft_probs[rows, num_accepted])  # [B, V]
    final_token = sample(final_dist, token_u.to(device)[rows, num_accepted])  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, K+1]
    tokens[rows, num_accepted] = final_token
    return tokens, num_accepted


def rule_uniforms(seqs: list[Sequence], K: int) -> tuple[list[list[float]], list[list[float]]]:
    """The rule's keyed draws for a step of up to K drafts, on the host: accept[b][i] tests draft
    i at position len(s) + i (keyed by the step too: a later step's drafts may reach that position
    again), token[b][i] draws the final token should the step end at i."""
    accept = [[uniform(s.key, len(s) + i, Purpose.ACCEPT, len(s)) for i in range(K)] for s in seqs]
    token = [[uniform(s.key, len(s) + i, Purpose.TOKEN) for i in range(K + 1)] for s in seqs]
    return accept, token


def standard_verify(flat_target_probs: torch.Tensor, seqs: list[Sequence], draft_lists: list[list[int]],
                    draft_probs: torch.Tensor | None) -> tuple[list[list[int]], list[int]]:
    """Lay p [sum(n_b + 1), V] out as [B, K+1, V] next to the draft's q (one-hot at each drafted
    token where the proposal has no probs) and apply `rejection_sample` with each request's keyed
    uniforms (`rule_uniforms`). Returns (tokens per sequence, num_accepted per sequence)."""
    device = flat_target_probs.device
    num_draft = [len(d) for d in draft_lists]
    B, K, V = len(seqs), max(num_draft), flat_target_probs.shape[-1]
    target_probs = flat_target_probs.new_zeros(B, K + 1, V)  # [B, K+1, V]
    draft_tokens = torch.zeros(B, K, dtype=torch.int64, device=device)  # [B, K]
    row = 0
    for b, d in enumerate(draft_lists):
        target_probs[b, : len(d) + 1] = flat_target_probs[row : row + len(d) + 1]
        draft_tokens[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
        row += len(d) + 1
    if draft_probs is None:  # q is one-hot at each drafted token
        draft_probs = torch.zeros_like(target_probs)
        for b, d in enumerate(draft_lists):
            draft_probs[b, : len(d)] = one_hot_q(d, V, device)
    else:
        draft_probs = draft_probs[:, : K + 1].to(device)
    accept, token = rule_uniforms(seqs, K)
    accept_u = torch.tensor(accept, dtype=torch.float64, device=device).view(B, K)  # [B, K]
    token_u = torch.tensor(token, dtype=torch.float64, device=device).view(B, K + 1)  # [B, K+1]
    tokens, num_accepted = rejection_sample(
        draft_tokens, torch.tensor(num_draft, device=device), draft_probs, target_probs, accept_u, token_u)
    return tokens.tolist(), num_accepted.tolist()


def greedy_verify(logits: torch.Tensor, draft_lists: list[list[int]], best: list[int] | None = None
                  ) -> tuple[list[list[int]], list[int]]:
    """The rule at temperature 0, where p and q are one-hot: accept d_i while it is the target's
    argmax at position i, then emit the argmax at the first mismatch (or the bonus argmax after n
    accepted drafts). One argmax over the flat logits [sum(n_b + 1), V] (it equals
    `rejection_sample` on the warped one-hot rows, and draws no random numbers). `best`: that
    argmax, when the caller already has it on the host. Returns (tokens, num_accepted) per sequence."""
    if best is None:
        best = logits.argmax(-1).tolist()  # [sum(n_b + 1)]: the lowest id among tied maxima, as warp_probs
    tokens, num_accepted, row = [], [], 0
    for drafts in draft_lists:
        n_acc = 0
        while n_acc < len(drafts) and drafts[n_acc] == best[row + n_acc]:
            n_acc += 1
        tokens.append(drafts[:n_acc] + [best[row + n_acc]])
        num_accepted.append(n_acc)
        row += len(drafts) + 1
    return tokens, num_accepted


def one_hot_q(tokens: list[int] | torch.Tensor, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """q of a deterministic proposal: [n, V], row i one-hot at tokens[i] (host ids, or int64 ids
    [n] already on the device: then nothing crosses)."""
    ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.int64, device=device)  # [n]
    return torch.zeros(len(ids), vocab_size, device=device).scatter_(1, ids[:, None], 1.0)
