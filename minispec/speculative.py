"""The production speculative step: the core's four steps, laid out for a device, with vLLM's options.

Read minispec/core/speculative.py first: it is the step (draft, verify, accept / reject, roll
back), the rejection rule and why it is exact, and greedy verification; this file imports the rule
from there. What it adds, each without changing the law of an emitted token:

  * one upload, one download a step (`speculative_step`): the host lays the whole step out (the
    drafter's forwards, the verification, the rule's keyed uniforms and warp), sends it in ONE
    copy from pinned staging (runtime/transfers.py), the device drafts, verifies and decides
    (`accept_on_device`: the same `rejection_sample` and greedy argmax), and ONE copy brings the
    verdict back;
  * pathwise sampling (pathwise.py) in the same one-upload step: the host uploads each pathwise
    request's NOISE lanes for the positions the step verifies, and the device accepts while the
    draft is the target's Gumbel-max token (`pathwise_accept`), so nothing a drafter does changes
    the tokens;
  * penalties and min_tokens in the same step (verification_options.py `penalized_on_device`,
    penalties.py `Penalties`): row j of a sequence's verification is penalised with its tokens'
    counts, kept on the device, plus the drafts before j, as a model drafter's q at that position
    is, so the law is the penalised target's; logprobs of the verified rows computed there too
    (`logprobs_on_device`), brought back in the same download;
  * the host path (`host_step`), the same step one forward and one host copy at a time: the
    reference twin of the one above (`penalized`, `top_logprobs`, pathwise.verify), which
    tests reach by making `needs_host` true;
  * non-finite target rows (nonfinite.py): a sequence whose final token would come from one
    finishes with an error instead of emitting a token drawn from garbage;
  * the engine's `emit`, which also checks stop strings and records logprobs and metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .core import speculative as rule  # the rule itself: rejection_sample, standard_verify, greedy_verify
from .core.speculative import StepResult, greedy_verify, rule_uniforms
from .drafters.base import Drafter, Drafts, Proposal, Staged
from .nonfinite import guard_nonfinite
from .pathwise import lane_gumbel_max, noise_lanes
from .pathwise import verify as pathwise_verify
from .penalties import Penalties
from .runtime.metrics import StepTimes
from .runtime.runner import Feed, ModelRunner
from .runtime.sequence import Sequence
from .runtime.transfers import Upload
from .sampling import WARP_DTYPES, WarpParams, finite_rows, warp_probs
from .verification_options import (host_logprobs, logprob_rows, logprobs_on_device, penalized,
                                   penalized_on_device, top_logprobs, with_sampled)


def speculative_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, k: int,
                     emit: Callable[[Sequence, int], bool], times: StepTimes) -> list[StepResult]:
    """Advance every sequence by one draft-verify-accept step (plain decoding with `NoDrafter`).
    Returns a `StepResult` per sequence.

    The host lays the whole step out first (the drafter's forwards, the verification, the rule's
    inputs) and sends it in ONE upload; the device then drafts, verifies and decides without
    waiting for the host, and ONE download brings the verdict (runtime/transfers.py), with the
    logprobs requests asked for. (`host_step` is its twin on the host, for tests: `needs_host`.)

    `emit(seq, token) -> bool` appends a token and says whether seq finished.
    Precondition (kept by the engine): seq.target_table.num_cached <= len(seq) - 1.
    """
    num_draft = [min(k, s.remaining - 1) for s in seqs]  # never more than the request may still emit (the final token is free)
    if any(needs_host(s) for s in seqs):
        return host_step(seqs, target, drafter, num_draft, emit, times)
    upload, V = Upload(), target.vocab_size
    new_tokens = Penalties.stage(upload, seqs, V)  # penalties and min_tokens (each one's new tokens), or None
    # 1. Draft, laid out: a model drafter's forwards (their tokens are drawn on the device), a
    # host drafter's tokens.
    staged = drafter.stage(seqs, num_draft, upload)
    # 2. Verify, laid out: ONE target forward feeds each sequence its uncached tokens plus its
    # drafts and scores the last n+1 positions; the rule's inputs ride along.
    feeds = [Feed(s.target_table, s.tokens[s.target_table.num_cached :] + t, len(t) + 1, drawn=len(t) if d else 0)
             for s, t, d in zip(seqs, staged.host_tokens, staged.drawn)]
    starts = [s.target_table.num_cached for s in seqs]
    verification = target.prepare(feeds, upload)
    stage_rule(upload, seqs, staged, V)
    sent = target.staging.send(upload)  # THE upload
    penalties = Penalties.from_upload(seqs, sent, new_tokens, V)  # (the counts brought up to date first)

    with times.timing("draft_s", target.device):
        drafts = drafter.run_staged(seqs, staged, sent, penalties)  # [B, K] on the device
    with times.verifying(seqs, target.device):
        drawn = drafts.tokens.flatten()[sent["drawn_index"]] if any(staged.drawn) else None  # [sum n_b] in feed order
        layers = drafter.target_layers
        out = target.run(verification, drawn=drawn, **({"hidden_layers": layers} if layers else {}))
        logits, hidden = out if layers else (out, None)  # [sum(n_b + 1), V], features or None
        # 3. Accept / reject, on the device; the verdict comes back in THE download.
        greedy = all(s.params.greedy for s in seqs)
        warp = None if greedy else staged_warp(seqs, sent, V)
        tokens, num_accepted, cut = accept_on_device(logits, sent, drafts, warp, penalties)
        logprobs = logprobs_on_device(logits, sent, tokens, seqs) if "logprob_rows" in sent else []
        tokens, num_accepted, cut, drafted, lengths, *logprobs = target.staging.download(
            [tokens, num_accepted, cut, drafts.tokens, drafts.num_draft, *logprobs])
    drafts_host = [d[: min(n[0], c[0])] for d, n, c in zip(drafted, lengths, cut)]
    failed = {b: len(s) + c[0] for b, (s, c, n, m) in enumerate(zip(seqs, cut, num_accepted, lengths))
              if c[0] <= m[0] and n[0] == c[0]}  # the final token would come from a non-finite row
    num_accepted = [n[0] for n in num_accepted]
    top = host_logprobs(seqs, logprobs, num_accepted)
    verdict = Verdict(drafts_host, tokens, num_accepted, failed, top)
    return conclude(seqs, target, drafter, verdict, starts, [len(f.tokens) for f in feeds], hidden, emit)


def host_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, num_draft: list[int],
              emit: Callable[[Sequence, int], bool], times: StepTimes) -> list[StepResult]:
    """The same four steps with the options read on the host (`verify_on_host`: logprobs,
    penalties and min_tokens; pathwise requests verified depth by depth), one forward and one host
    copy at a time: the reference twin of `speculative_step`, same tokens, same law."""
    with times.timing("draft_s", target.device):
        proposal = drafter.propose(seqs, num_draft)
    with times.verifying(seqs, target.device):
        feeds = [Feed(s.target_table, s.tokens[s.target_table.num_cached :] + d, len(d) + 1)
                 for s, d in zip(seqs, proposal.tokens)]
        starts = [s.target_table.num_cached for s in seqs]
        verdict, hidden = verify_on_host(target, feeds, seqs, proposal, drafter.target_layers)
    return conclude(seqs, target, drafter, verdict, starts, [len(f.tokens) for f in feeds], hidden, emit)


def conclude(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, verdict: "Verdict", starts: list[int],
             num_fed: list[int], hidden: torch.Tensor | None, emit: Callable[[Sequence, int], bool]) -> list["StepResult"]:
    """Emit each sequence's tokens, then 4. Roll back (`roll_back`)."""
    emit_accepted(seqs, verdict.tokens, verdict.num_accepted, [len(d) for d in verdict.drafts], verdict.top,
                  verdict.failed, emit)
    roll_back(seqs, target, drafter, starts, num_fed, hidden)
    return [StepResult(d, n, len(d)) for d, n in zip(verdict.drafts, verdict.num_accepted)]


def roll_back(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, starts: list[int],
              num_fed: list[int], hidden: torch.Tensor | None) -> None:
    """4. Roll back, once the step emitted (a chain's or a tree's on the device): keep the K/V of
    the emitted tokens (the newest is fed next step) and drop a finished sequence's penalty counts
    (penalties.Penalties); the drafter keeps the target's features of the fed positions (hidden,
    num_fed[b] rows per sequence from starts[b]) and forgets the rest."""
    for s in seqs:
        s.target_table.truncate(len(s) - 1, target.cache.allocator)
        if s.finish_reason is not None:
            s.token_counts = None
    if hidden is not None:
        drafter.observe(seqs, starts, num_fed, hidden)
    drafter.rollback(seqs)


@dataclass
class Verdict:
    """What verification decided, per sequence b: drafts[b], the drafts verified (a proposal cut at
    a non-finite target row keeps those before it); tokens[b], its accepted drafts then the final
    token; num_accepted[b]; failed: {b: the position of its non-finite row} for sequences whose
    final token would come from that row (nonfinite.py); top: requested logprobs per b, or None:
    per verified position, (its top tokens' {id: Logprob}, what `with_sampled` completes them
    with)."""

    drafts: list[list[int]]
    tokens: list[list[int]]
    num_accepted: list[int]
    failed: dict[int, int]
    top: list


def needs_host(seq: Sequence) -> bool:
    """Whether seq's step must run on the host (`host_step`). None must: penalties and min_tokens
    read token counts kept on the device, logprobs come back in the step's download, pathwise
    noise is made on the device from uploaded lanes. Tests make it true to compare the two twins."""
    return False


def stage_rule(upload: Upload, seqs: list[Sequence], staged: Staged, vocab_size: int) -> None:
    """What the rule needs besides the logits, known on the host before the step (B sequences of
    up to K = max(staged.lengths) drafts): verify_rows [B, K+1], sequence b's row of the flat
    logits at position i (past its drafts, its last row again); drawn_index, where the verified
    drafts drawn on the device sit in the drafts [B, K]; unless every request is greedy, each
    row's warp parameters and the keyed uniforms accept_u [B, K] and token_u [B, K+1]; and with
    pathwise requests among them, pathwise_rows [P] (their batch rows) and noise_lanes [P, K+1, 2],
    the NOISE lanes of positions len(s) .. len(s) + K (`pathwise_accept`); with requests asking for
    logprobs, logprob_rows [L] (their batch rows)."""
    K = max(staged.lengths, default=0)
    first, rows, drawn = 0, [], []
    for b, n in enumerate(staged.lengths):
        rows.append([first + min(i, n) for i in range(K + 1)])
        drawn += [b * K + i for i in range(n)] if staged.drawn[b] else []
        first += n + 1
    upload.add("verify_rows", rows)  # [B, K+1]
    upload.add("drawn_index", drawn)  # [sum drawn n_b]
    asking = logprob_rows(seqs)
    if asking:
        upload.add("logprob_rows", asking)  # [L]
    if not all(s.params.greedy for s in seqs):
        for name, values in WarpParams.arrays([s.params for s in seqs for _ in range(K + 1)], vocab_size).items():
            upload.add("warp." + name, values, WARP_DTYPES[name])  # [B * (K+1)]
        accept, token = rule_uniforms(seqs, K)
        upload.add("accept_u", accept, torch.float64)  # [B, K]
        upload.add("token_u", token, torch.float64)  # [B, K+1]
        chosen = [b for b, s in enumerate(seqs) if s.pathwise]
        if chosen:
            lanes = [noise_lanes([seqs[b].key] * (K + 1), [len(seqs[b]) + i for i in range(K + 1)])
                     for b in chosen]
            upload.add("pathwise_rows", chosen)  # [P]
            upload.add("noise_lanes", lanes)  # [P, K+1, 2]


def staged_warp(seqs: list[Sequence], sent: dict[str, torch.Tensor], vocab_size: int) -> WarpParams:
    """The verification rows' warp, its tensors from the upload (`stage_rule`)."""
    return WarpParams.of([s.params for s in seqs], vocab_size, None, {name: sent["warp." + name] for name in WARP_DTYPES})


def accept_on_device(logits: torch.Tensor, sent: dict[str, torch.Tensor], drafts: Drafts,
                     warp: WarpParams | None, penalties: Penalties | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule of step 3 on the device, for B sequences of up to K drafts.

    logits: [R, V] the flat verification rows; sent: verify_rows [B, K+1] (sequence b's row of
    position i), and unless greedy accept_u [B, K] and token_u [B, K+1]; drafts: tokens [B, K],
    num_draft [B], probs [B, K+1, V] q or None where q is one-hot; warp: each row's warp (None:
    every request is greedy: accept while the draft is the argmax, emit the argmax); penalties:
    the batch's penalties and min_tokens, applied to each row first (`penalized_on_device`).
    A sequence's first non-finite row ends its verification there (nonfinite.py): its drafts from
    that row on are dropped and the row is zeroed, so the rule stays in range.
    Returns tokens [B, K+1] (row b emits tokens[b, :num_accepted[b] + 1]), num_accepted [B] and
    cut [B]: the first non-finite row, K+1 where there is none."""
    rows, draft_tokens = sent["verify_rows"], drafts.tokens  # [B, K+1], [B, K]
    B, K = draft_tokens.shape
    target_logits = logits[rows]  # [B, K+1, V]
    if penalties is not None:
        drafted = torch.arange(K, device=logits.device)[None, :] < drafts.num_draft[:, None]
        target_logits = penalized_on_device(target_logits, penalties, draft_tokens, drafted)
    finite = finite_rows(target_logits.flatten(0, 1)).view(B, K + 1)  # [B, K+1]
    cut = finite.long().cumprod(-1).sum(-1)  # [B]
    num_draft = torch.minimum(drafts.num_draft, cut)  # [B]
    target_logits = torch.where(finite[..., None], target_logits, 0.0)  # [B, K+1, V]
    drafted = torch.arange(K, device=logits.device)[None, :] < num_draft[:, None]  # [B, K]
    if warp is None:  # greedy verification: no warp, no random numbers
        return (*accept_matching(target_logits.argmax(-1), draft_tokens, drafted), cut)
    V = logits.shape[-1]
    target_probs = warp_probs(target_logits.flatten(0, 1), warp).view(B, K + 1, V)  # [B, K+1, V]
    kept = torch.cat([drafted, drafted.new_zeros(B, 1)], dim=1)[..., None]  # [B, K+1, 1]
    draft_probs = drafts.probs
    if draft_probs is None:  # q is one-hot at each drafted token
        draft_probs = torch.zeros_like(target_probs)
        draft_probs[:, :K].scatter_(-1, draft_tokens[..., None], 1.0)
    draft_probs = draft_probs[:, : K + 1].to(target_probs.device) * kept  # [B, K+1, V], zero past the drafts
    tokens, num_accepted = rule.rejection_sample(draft_tokens, num_draft, draft_probs, target_probs, sent["accept_u"],
                                            sent["token_u"])
    if "pathwise_rows" in sent:
        chosen = sent["pathwise_rows"]  # [P]
        verdict = pathwise_accept(target_probs[chosen], sent["noise_lanes"], draft_tokens[chosen], drafted[chosen])
        tokens[chosen], num_accepted[chosen] = verdict
    return tokens, num_accepted, cut


def pathwise_accept(target_probs: torch.Tensor, lanes: torch.Tensor, draft_tokens: torch.Tensor,
                    drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pathwise.verify on the device, for P pathwise sequences: target_probs [P, K+1, V] the warped
    verification rows, lanes [P, K+1, 2] each position's NOISE lanes, draft_tokens [P, K], drafted
    [P, K] which drafts are real. Every row's Gumbel-max token is computed (pathwise.verify only
    reaches the rows it needs; the others' tokens are unused), drafts are accepted while they equal
    it, and the token at the first mismatch (or the bonus) is emitted. Returns tokens [P, K+1] and
    num_accepted [P], as the greedy rule's."""
    P, K1, V = target_probs.shape
    best = lane_gumbel_max(target_probs.flatten(0, 1), lanes.flatten(0, 1)).view(P, K1)  # [P, K+1]
    return accept_matching(best, draft_tokens, drafted)


def accept_matching(best: torch.Tensor, draft_tokens: torch.Tensor, drafted: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while each equals the token the target picks at its position (greedy: the
    argmax; pathwise: the Gumbel-max), then emit that pick at the first mismatch (or the bonus).
    best [B, K+1], draft_tokens [B, K], drafted [B, K] (which drafts are real) -> tokens [B, K+1]
    (row b emits tokens[b, :num_accepted[b] + 1]) and num_accepted [B]."""
    K = draft_tokens.shape[1]
    num_accepted = ((best[:, :K] == draft_tokens) & drafted).long().cumprod(-1).sum(-1)  # [B]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(len(best), 1)], dim=1)  # [B, K+1]
    tokens.scatter_(1, num_accepted[:, None], best.gather(1, num_accepted[:, None]))
    return tokens, num_accepted


def verify_on_host(target: ModelRunner, feeds: list[Feed], seqs: list[Sequence], proposal: Proposal,
                   layers: tuple[int, ...]) -> tuple[Verdict, torch.Tensor | None]:
    """Verification with the options that read tokens on the host: logprobs of the raw logits
    (as vLLM's), penalties and min_tokens position by position, non-finite rows (nonfinite.py),
    then greedy verification, the rejection rule or pathwise verification (`sample_verify`)."""
    logits, hidden = verify_forward(target, feeds, layers)
    top = top_logprobs(logits, seqs, [len(d) for d in proposal.tokens])  # of the raw logits, as vLLM's
    logits = penalized(logits, seqs, proposal.tokens)  # penalties and min_tokens, position by position
    greedy = all(s.params.greedy for s in seqs)
    logits, proposal, failures, best = guard_nonfinite(logits, proposal, seqs, greedy)
    if greedy:
        tokens, num_accepted = greedy_verify(logits, proposal.tokens, best)
    else:
        tokens, num_accepted = sample_verify(logits, seqs, proposal)
    failed = {b: pos for b, pos in failures.items() if num_accepted[b] == len(proposal.tokens[b])}  # the final token's row is broken
    return Verdict(proposal.tokens, tokens, num_accepted, failed, top), hidden


# --- 3. The accept / reject rule ----------------------------------------------------------------


def sample_verify(logits: torch.Tensor, seqs: list[Sequence], proposal: Proposal) -> tuple[list[list[int]], list[int]]:
    """Verify each request by its rule on the flat logits [sum(n_b + 1), V]: `standard_verify`
    (the rejection rule) on the warped rows, or, for pathwise requests, accept while the draft is
    the target's Gumbel-max token (pathwise.verify, which warps the rows it reaches). Returns
    (tokens per sequence, num_accepted per sequence)."""
    draft_lists = proposal.tokens
    firsts = [0]  # each sequence's first row of the flat logits
    for d in draft_lists:
        firsts.append(firsts[-1] + len(d) + 1)
    pathwise = [b for b, s in enumerate(seqs) if s.pathwise]
    standard = [b for b, s in enumerate(seqs) if not s.pathwise]
    tokens, num_accepted = [None] * len(seqs), [0] * len(seqs)
    if pathwise:
        verdicts = pathwise_verify(logits, [seqs[b].params for b in pathwise], [seqs[b].key for b in pathwise],
                                   [len(seqs[b]) for b in pathwise], [draft_lists[b] for b in pathwise],
                                   [firsts[b] for b in pathwise])
        for b, t, n in zip(pathwise, *verdicts):
            tokens[b], num_accepted[b] = t, n
    if standard:
        draft_probs = proposal.probs
        if pathwise:  # (a mixed batch: the standard requests' rows)
            logits = logits[[r for b in standard for r in range(firsts[b], firsts[b + 1])]]
            draft_probs = None if draft_probs is None else draft_probs[torch.tensor(standard, device=draft_probs.device)]
        params = [seqs[b].params for b in standard for _ in range(len(draft_lists[b]) + 1)]
        verdicts = rule.standard_verify(warp_probs(logits, params), [seqs[b] for b in standard], [draft_lists[b] for b in standard],
                                   draft_probs)
        for b, t, n in zip(standard, *verdicts):
            tokens[b], num_accepted[b] = t, n
    return tokens, num_accepted


# --- The step's helpers ---------------------------------------------------------------------------


def verify_forward(target: ModelRunner, feeds: list[Feed], layers: tuple[int, ...], upload: Upload | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's forward: logits [sum(num_logits), V], and the inputs of `layers` at every fed
    position [sum(fed), len(layers) * H] when a drafter reads them (else None). upload: what the
    step sends up with the forward's metadata (runtime/transfers.py)."""
    if layers:
        return target.forward(feeds, upload=upload, hidden_layers=layers)
    return target.forward(feeds, upload=upload), None


def emit_accepted(seqs: list[Sequence], tokens: list[list[int]], num_accepted: list[int], num_drafted: list[int],
                  top: list, failures: dict[int, int], emit: Callable[[Sequence, int], bool]) -> None:
    """Emit each sequence's accepted run plus one token, stopping early at EOS / stop strings /
    max_tokens, with requested logprobs (`top_logprobs`: emitted token j of sequence b was sampled
    at its verified position j), and count drafted / accepted positions. A sequence in `failures`
    (whose final token would come from a non-finite row, see `guard_nonfinite`) emits only its
    accepted drafts and finishes with finish_reason "error"."""
    for b, (s, toks, n_acc, n_draft, rows) in enumerate(zip(seqs, tokens, num_accepted, num_drafted, top)):
        fails = b in failures
        s.metrics.record(n_draft, n_acc)
        for j, t in enumerate(toks[: n_acc + (0 if fails else 1)]):
            if rows is not None:
                s.logprobs.append(with_sampled(*rows[j], t))
            if emit(s, t):
                break
        if fails and s.finish_reason is None:
            s.finish_reason = "error"
            s.error = f"the target's logits are not finite (NaN or inf) for the token at position {failures[b]}"


