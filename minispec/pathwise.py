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
the price of the verifier not reading q.
"""

from __future__ import annotations

import torch

from .randomness import Key, gumbel

PATHWISE_SAMPLING = ("off", "seeded", "on")  # the LLM's choices for requests that do not say: none, seeded ones, all


def gumbel_max(probs: torch.Tensor, keys: list[Key], positions: list[int], token_ids: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Row r's Gumbel-max token: argmax_j (log probs[r, j] + G_{positions[r]}(token_ids[j])) with
    the noise of keys[r]. probs: [N, M] (a draft's columns, or the vocabulary); token_ids: [M] the
    token id of each column (None: column j is token j). Returns [N] int64 column indices."""
    if token_ids is None:
        token_ids = torch.arange(probs.shape[-1], device=probs.device)
    noise = gumbel(keys, positions, token_ids)  # [N, M] fp64
    return (probs.double().log() + noise).argmax(-1)  # [N]
