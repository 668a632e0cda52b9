"""Pathwise sampling: Gumbel-max with noise keyed by (seed, position), so that speculation cannot
change a seeded request's tokens (Daliri, Musco, Suresh 2024, "Coupling without communication and
drafter-invariant speculative decoding").

The rule. At position t the request has Gumbel noise G_t = (G_t(x))_x over the vocabulary,
G_t(x) = -log(-log U(seed, t, NOISE, x)) (randomness.py): independent standard Gumbels,
independent across positions, the same in every step, batch and drafter. With p_t the target's
warped distribution at t (penalties and min_tokens, then temperature, top-k, top-p: the same p as
the standard rule's),
    plain decoding      emits x_t = argmax_x (log p_t(x) + G_t(x));
    a sampling drafter  drafts d_t = argmax_x (log q_t(x) + G_t(x)), the SAME noise (a draft
                        model, an EAGLE head; a one-hot drafter, lookup or a tree, as before);
    verification        accepts d_t iff d_t == x_t, computed from the verification row of p_t,
                        and emits x_t at the first mismatch (or the bonus x_{t+n} after n drafts);
    a tree              accepts a node iff it is x_t for its parent's row, and emits x_t where the
                        walk finds no such child.
Greedy requests are unchanged (one-hot p: the argmax).

The law: Gumbel-max gives p exactly. With E(x) = exp(-G_t(x)), P(E(x) > s) = P(G < -log s) =
exp(-s): the E(x) are independent Exp(1), and log p(x) + G(x) = -log(E(x) / p(x)), so x_t is the
argmin of E(x) / p(x), independent exponentials of rates p(x). The least of independent
exponentials is the one of rate p(x) with probability p(x) / sum_y p(y) = p(x) (a token with
p(x) = 0 has log p(x) = -inf and never wins; ties have probability 0). Sequentially: p_t is a
function of x_<t, which is a function of G_<t, independent of G_t; so given x_<t, x_t ~ p_t, and
by the chain rule the tokens follow the target's autoregressive law.

The path: speculation emits plain decoding's tokens, token for token. Let y_t be plain pathwise
decoding's token at t. A step at a sequence whose tokens so far are plain decoding's verifies rows
i = 1..n+1; row i is the target's distribution after the drafts d_1..d_{i-1}. If d_1..d_{i-1}
were accepted they equal y's, so row i is plain decoding's p at that position and its Gumbel-max
is y; the step accepts d_i iff d_i == y, and emits y at the first mismatch or as the bonus. So
each step emits the next num_accepted + 1 tokens of y, whatever was drafted, however (any
drafter, any k, speculation by load, lookup, trees, a draft skipped after a preemption) and in
whatever batch: the tokens are a function of the seed and the target alone. (Up to the target's
own floating point: a verification row is computed in another batch shape than plain decoding's
row; with row_invariant=True they are equal bit for bit, as greedy decoding's are.) A tree's walk
follows y as far as the tree holds it, then emits y's next token.

What it costs: acceptance. A one-hot draft d (n-gram, lookup, a tree's nodes) is accepted with
probability p(d) under either rule: nothing. A sampling drafter's d = argmax(log q + G) equals x
with probability sum_x 1 / sum_y max(p(y)/p(x), q(y)/q(x)) >= (1 - TV) / (1 + TV), TV the total
variation between p and q (the P-MinHash bound), where the standard rule accepts with probability
1 - TV exactly, the most any coupling can: e.g. TV = 0.2 gives >= 0.67 against 0.8. The cost is
the price of the verifier not reading q. And compute: noise over the vocabulary for every token
decided (the drafts, and the verification's rows a step reaches, depth by depth), or over the
tokens top-k / top-p keep (`gumbel_max`); docs/results.md has its cost on a CPU. A step laid out
for the device (speculative.py) makes the noise there from lanes uploaded with the step
(`noise_lanes`, `lane_gumbel_max`): over the whole vocabulary, for every row it verifies.
"""

from __future__ import annotations

import torch

from .randomness import Key, Purpose, finish, noise, row_lanes, spread
from .sampling import SamplingParams, warp_probs

PATHWISE_SAMPLING = ("off", "seeded", "on")  # the LLM's choices for requests that do not say: none, seeded ones, all


def gumbel_max(probs: torch.Tensor, keys: list[Key], positions: list[int], token_ids: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Row r's Gumbel-max token: argmax_j (log probs[r, j] + G_{positions[r]}(token_ids[j])) with
    the noise of keys[r]. probs: [N, M] (a draft's columns, or the vocabulary); token_ids: [M] the
    token id of each column (None: column j is token j). Returns [N] int64 column indices.

    With G = -log(-log u), log p + G = -log((-log u) / p) decreases with (-log u) / p, so the
    argmax is that of log(u) / p (the exponential race of the module docstring): one logarithm
    per token instead of three, the same token. A token with p = 0 never wins (-inf), so where
    top-k / top-p leave few tokens the noise is made for those only (one host copy to count
    them): the same token, for the cost of the tokens kept."""
    if token_ids is None:
        token_ids = torch.arange(probs.shape[-1], device=probs.device)
    kept = int((probs > 0).sum(-1).max())
    if kept * SPARSE <= probs.shape[-1]:
        values, columns = probs.topk(kept, dim=-1)  # [N, kept]: every kept token (and zeros where a row keeps fewer)
        race = noise(keys, positions, token_ids[columns]).log_().div_(values.double())  # [N, kept] fp64
        return columns.gather(-1, race.argmax(-1, keepdim=True)).squeeze(-1)  # [N]
    lanes = torch.tensor(noise_lanes(keys, positions), dtype=torch.int64, device=probs.device).view(-1, 2)  # [N, 2]
    return lane_gumbel_max(probs, lanes, token_ids)  # [N]: the race over every column


SPARSE = 8  # noise for the kept tokens only when they are at most 1/SPARSE of the columns (topk costs more above)


def noise_lanes(keys: list[Key], positions: list[int]) -> list[Key]:
    """Row r's two NOISE lanes, for keys[r] at positions[r] (randomness.row_lanes), computed on the
    host: what a step uploads so that the device can make the noise itself (`lane_gumbel_max`)."""
    return [row_lanes(k, p, Purpose.NOISE) for k, p in zip(keys, positions)]


def lane_gumbel_max(probs: torch.Tensor, lanes: torch.Tensor, token_ids: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """`gumbel_max` on the device, the noise made from uploaded lanes: probs [N, M], lanes [N, 2]
    int64 (`noise_lanes`), token_ids [M] as in gumbel_max. Returns [N] int64 column indices.

    gumbel_max's race over every column (u from randomness.finish, then the argmax of log(u) / p: a
    token with p = 0 gets -inf and never wins, ties go to the lowest column): gumbel_max runs it
    here. It never takes gumbel_max's kept-tokens shortcut (the same token but for exact ties of
    the race): counting the kept tokens is a host copy, and a step laid out ahead makes none."""
    if token_ids is None:
        token_ids = torch.arange(probs.shape[-1], device=probs.device)
    u = finish(lanes[:, :1], lanes[:, 1:], spread(token_ids[None, :]))  # [N, M] fp64 in (0, 1)
    race = u.log_()  # log u < 0
    return race.div_(probs.double()).argmax(-1)  # [N]


def verify(logits: torch.Tensor, params: list[SamplingParams], keys: list[Key], lengths: list[int],
           draft_lists: list[list[int]], first_rows: list[int]) -> tuple[list[list[int]], list[int]]:
    """Chain verification: sequence b's row j of the flat logits [R, V] (row first_rows[b] + j),
    warped with params[b], gives the target's token at position lengths[b] + j; accept drafts
    while they equal it, then emit it. Row j is looked at only once drafts 1..j were accepted, so
    rows are warped and their noise made depth by depth, for the rows reached: as many as the
    tokens the step emits. Returns (tokens, num_accepted) per sequence, as speculative.greedy_verify."""
    accepted, finals, alive = [0] * len(keys), [0] * len(keys), list(range(len(keys)))
    while alive:
        rows = torch.tensor([first_rows[b] + accepted[b] for b in alive], device=logits.device)
        probs = warp_probs(logits[rows], [params[b] for b in alive])  # [A, V]
        best = gumbel_max(probs, [keys[b] for b in alive], [lengths[b] + accepted[b] for b in alive])  # [A]
        still = []
        for b, token in zip(alive, best.tolist()):
            if accepted[b] < len(draft_lists[b]) and draft_lists[b][accepted[b]] == token:
                accepted[b] += 1
                still.append(b)
            else:
                finals[b] = token
        alive = still
    return [d[:n] + [f] for d, n, f in zip(draft_lists, accepted, finals)], accepted
