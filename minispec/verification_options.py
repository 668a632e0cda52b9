"""vLLM's options on a speculative step's verification rows: penalties, min_tokens and logprobs,
on the host and the same on the device, side by side.

Penalties and min_tokens: row j of a sequence's verification sees the sequence's tokens, then its
first j drafts, the history the drafter's row j saw too (`penalized` from token lists on the host;
`penalized_on_device` from the counts kept on the device, penalties.py `Penalties`, plus the drafts'
cumulative counts). The same formula on the same history, so the law is the penalised target's.

Logprobs: each verified row's log_softmax of the RAW logits (before penalties and the warp, as
vLLM's), its top tokens and the emitted token's rank (`top_logprobs` with a host copy per row;
`logprobs_on_device`, brought back in the step's one download and unpacked by `host_logprobs`;
a tree step's path rows go through the same `logprobs_of_rows`, tree_options_on_device.py).
They only report: no emitted token depends on them. `with_sampled` completes a position's entries
with the token the step emitted there.
"""

from __future__ import annotations

import torch

from .outputs import Logprob
from .penalties import Penalties, penalize
from .runtime.sequence import Sequence


def penalized(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
    """The flat verification logits [sum(n_b + 1), V] with each request's penalties and min_tokens
    applied (penalties.penalize); row j of sequence b sees the tokens before its position: the
    sequence's, then its first j drafts, the history the drafter's row j saw too."""
    if not any(s.params.adjusts_logits for s in seqs):
        return logits
    return penalize(logits, [s.penalty_row(d[:j]) for s, d in zip(seqs, drafts) for j in range(len(d) + 1)])


def penalized_on_device(target_logits: torch.Tensor, penalties: Penalties,
                        draft_tokens: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """`penalized` on the device: target_logits [B, K+1, V], row j of sequence b penalised with
    b's tokens (penalties: their counts, kept on the device) and its first j drafts (draft_tokens
    [B, K], those with drafted [B, K]): the cumulative count of the drafts before each row."""
    B, K1, V = target_logits.shape
    device = target_logits.device
    before = torch.zeros(B, K1, V, device=device)  # [B, K+1, V]
    # row j + 1 gets draft j, then a running sum: the counts of the drafts before each row
    before[:, 1:].scatter_(-1, draft_tokens[..., None], drafted[..., None].float())
    before = before.cumsum(1)  # [B, K+1, V]
    batch_rows = torch.arange(B, device=device)[:, None].expand(B, K1).flatten()  # [B * (K+1)]
    depth = torch.arange(K1, device=device)[None, :].expand(B, K1).flatten()  # [B * (K+1)]
    out = penalties.apply(target_logits.flatten(0, 1), batch_rows, before.flatten(0, 1), depth)
    return out.view(B, K1, V)


def top_logprobs(logits: torch.Tensor, seqs: list[Sequence], num_draft: list[int]) -> list:
    """For sequences that asked for logprobs: per verified position, ({top id: Logprob}, the
    position's full log_softmax row) from the raw logits [sum(n_b + 1), V]; None for the others."""
    out, row = [], 0
    for s, n in zip(seqs, num_draft):
        if s.params.logprobs is None:
            out.append(None)
        else:
            lp = logits[row : row + n + 1].float().log_softmax(-1).cpu()  # [n + 1, V]
            values, ids = lp.topk(min(s.params.logprobs, lp.shape[-1]), dim=-1)
            out.append([({i: Logprob(v, rank) for rank, (i, v) in enumerate(zip(i_.tolist(), v_.tolist()), 1)}, r)
                        for i_, v_, r in zip(ids, values, lp)])
        row += n + 1
    return out


def logprob_rows(seqs: list[Sequence]) -> list[int]:
    """The batch rows of the requests that asked for logprobs (the L rows the device computes)."""
    return [b for b, s in enumerate(seqs) if s.params.logprobs is not None]


def logprobs_on_device(logits: torch.Tensor, sent: dict[str, torch.Tensor], tokens: torch.Tensor,
                       seqs: list[Sequence]) -> list[torch.Tensor]:
    """`top_logprobs` on the device, for the L sequences that asked (logprob_rows [L]): their
    verified rows (verify_rows) and the tokens the step emits there (tokens [B, K+1]), through
    `logprobs_of_rows`. Returns its four tensors for the step's download."""
    chosen = sent["logprob_rows"]  # [L]
    return logprobs_of_rows(logits, sent["verify_rows"][chosen], tokens[chosen], seqs)


def logprobs_of_rows(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                     seqs: list[Sequence]) -> list[torch.Tensor]:
    """For L sequences' K+1 positions each, rows [L, K+1] of the raw logits [R, V] (before
    penalties and the warp, as vLLM's) and the tokens [L, K+1] emitted there: each row's
    log_softmax, its n most likely tokens (n the largest number asked), and the emitted token's
    log-probability and rank (vLLM's: the tokens at least as likely, itself included). Returns
    [top ids [L, (K+1) n], top values [L, (K+1) n] fp32, the emitted tokens' logprobs [L, K+1]
    fp32, their ranks [L, K+1]]: the chain's (`logprobs_on_device`) and the tree's
    (tree_options_on_device.py) downloads."""
    n = min(max(s.params.logprobs for s in seqs if s.params.logprobs is not None), logits.shape[-1])
    lp = logits[rows].float().log_softmax(-1)  # [L, K+1, V]
    values, ids = lp.topk(n, dim=-1)  # [L, K+1, n]
    emitted = lp.gather(-1, tokens[..., None])  # [L, K+1, 1]
    rank = (lp >= emitted).sum(-1)  # [L, K+1]
    return [ids.flatten(1), values.flatten(1), emitted.squeeze(-1), rank]


def host_logprobs(seqs: list[Sequence], downloaded: list, num_accepted: list[int]) -> list:
    """`Verdict.top` from `logprobs_on_device`'s download: per sequence that asked, per emitted
    position j, ({top id: Logprob}, the emitted token's Logprob); None for the others."""
    top: list = [None] * len(seqs)
    if not downloaded:
        return top
    ids, values, emitted, ranks = downloaded
    asking = logprob_rows(seqs)
    n = len(ids[0]) // len(emitted[0])  # the top count computed for every row
    for i, b in enumerate(asking):
        m = min(seqs[b].params.logprobs, n)
        top[b] = []
        for j in range(num_accepted[b] + 1):  # (the emitted positions only)
            best = zip(ids[i][j * n : j * n + m], values[i][j * n : j * n + m])
            top[b].append(({t: Logprob(v, r) for r, (t, v) in enumerate(best, 1)},
                           Logprob(emitted[i][j], ranks[i][j])))
    return top


def with_sampled(top: dict[int, Logprob], row: torch.Tensor | Logprob, token: int
                 ) -> dict[int, Logprob]:
    """The top entries plus the sampled token's; its rank is vLLM's: the tokens at least as likely,
    itself and its ties included (a top entry keeps its place in the top). row: the position's
    log_softmax row [V], or the token's Logprob already computed (`logprobs_on_device`)."""
    if token in top:
        return dict(top)
    if isinstance(row, Logprob):
        return {**top, token: row}
    return {**top, token: Logprob(row[token].item(), int((row >= row[token]).sum()))}
