"""The autoregressive draft loop laid out for a step's one upload and run on the device.

drafters/base.py's `AutoregressiveDrafter` drafts with the core's loop (`DraftLoop.propose`): a
forward, a draw, a host copy, the next forward. Here is the same loop as the one-upload step
needs it (speculative.py): `stage` lays every depth's forward and draw inputs (warp parameters,
keyed DRAFT uniforms, a pathwise request's noise lanes) out in the upload before anything runs,
and `run_staged` runs the depths back to back on the device, each forward reading the tokens the
previous one drew there, never on the host. It draws what `propose` draws (the same warp, the same
keyed uniforms, the same penalties: `adjust_staged`) and stops a sequence where `propose` would,
so the drafts, and with them the step's law and tokens, are the host loop's
(tests/test_transfers.py, test_adaptive_on_device.py compare them).

`DraftLoopOnDevice` is a mixin of `AutoregressiveDrafter`: it uses that class's forwards
(`first_feeds`, `feed_ahead`, `split`, `chain_args`) and attributes (`runner`, `vocab_size`,
`draft_ids`, `confidence_threshold`, `draftable`).
"""

from __future__ import annotations

import torch

from ..core.drafters import draft_uniforms, drop_nonfinite
from ..pathwise import lane_gumbel_max, noise_lanes
from ..penalties import Penalties
from ..runtime.runner import Feed
from ..runtime.sequence import Sequence
from ..runtime.transfers import Upload
from ..sampling import WARP_DTYPES, WarpParams, sample, warp_probs
from .staged import Drafts, Staged


class DraftLoopOnDevice:
    """`AutoregressiveDrafter`'s loop in one upload (module docstring)."""

    confidence_on_device: bool | None = None  # where a confidence threshold stops: see `stops_on_device`

    def stage(self, seqs: list[Sequence], num_draft: list[int], upload: Upload) -> Staged:
        """Lay out the draft loop's forwards (`propose`'s, with the same sequences active at each
        depth) and each depth's draw inputs (warp parameters, DRAFT uniforms; for pathwise requests
        their rows among the active ones and the NOISE lanes of the drafted position) in the step's
        upload: the loop then runs on the device with no host round-trip (`run_staged`).

        With a confidence threshold the stop is decided where `stops_on_device` says: on the
        device, the loop's forwards all run and a sequence's draws past its stop fall past its
        num_draft; on the host, the loop is `propose`'s (a host copy a depth)."""
        if self.confidence_threshold is not None and not self.stops_on_device:
            return super().stage(seqs, num_draft, upload)  # (Drafter.stage: `propose`, its tokens uploaded)
        lengths = [self.draftable(s, n) if n > 0 else 0 for s, n in zip(seqs, num_draft)]
        prefix = upload.scope()
        upload.add(prefix + "num_draft", lengths)  # [B]
        greedy = all(s.params.greedy for s in seqs)
        width = self.vocab_size if self.draft_ids is None else len(self.draft_ids)  # V_d, the logits' width
        forwards, active, previous, ahead = [], [b for b, n in enumerate(lengths) if n > 0], [], []
        for i in range(max(lengths, default=0)):
            if i == 0:
                ahead = self.feed_ahead([seqs[b] for b in active], upload)
                feeds, args = self.first_feeds(seqs, active)
            else:  # each active sequence feeds the token it drew at depth i - 1, on the device
                feeds, args = [Feed(seqs[b].draft_table, [0], drawn=1) for b in active], None
                upload.add(f"{prefix}keep{i}", [previous.index(b) for b in active])  # [A_i] rows of depth i - 1
            forwards.append((active, self.runner.prepare(feeds, upload), args))
            upload.add(f"{prefix}rows{i}", active)  # [A_i] batch rows
            if not greedy:
                for name, values in WarpParams.arrays([seqs[b].params for b in active], width).items():
                    upload.add(f"{prefix}warp{i}.{name}", values, WARP_DTYPES[name])
                upload.add(f"{prefix}u{i}", draft_uniforms([seqs[b] for b in active], i), torch.float64)  # [A_i]
                chosen = [r for r, b in enumerate(active) if seqs[b].pathwise]
                if chosen:  # (draw_from's Gumbel-max, at position len(s) + i)
                    upload.add(f"{prefix}pathwise{i}", chosen)  # [P_i] rows of depth i
                    drawing = [seqs[active[r]] for r in chosen]
                    lanes = noise_lanes([s.key for s in drawing], [len(s) + i for s in drawing])
                    upload.add(f"{prefix}noise{i}", lanes)  # [P_i, 2]
            previous, active = active, [b for b in active if lengths[b] > i + 1]
        return Staged(lengths, [[0] * n for n in lengths], [n > 0 for n in lengths], forwards, prefix, ahead=ahead)

    @property
    def stops_on_device(self) -> bool:
        """Whether a confidence threshold's stop is decided on the device, in the step's one
        upload and one download, or on the host, where stopping saves the forwards after the last
        sequence's stop but costs a host copy a depth. `confidence_on_device` if set, else on
        CUDA: there a host copy a depth stalls the launch queue and a graphed draft forward is
        cheap; on a CPU the forwards are the cost (docs/kernels-and-gpu.md has the measurement).
        Either way the same drafts: the stop depends only on what was drafted."""
        if self.confidence_on_device is not None:
            return self.confidence_on_device
        return self.runner.device.type == "cuda"

    def run_staged(self, seqs: list[Sequence], staged: Staged, sent: dict[str, torch.Tensor],
                   penalties: Penalties | None = None) -> Drafts:
        """`propose`'s loop on the device: depth i feeds the tokens depth i - 1 drew (never read on
        the host), penalises the logits as `adjust` does (`adjust_staged`, with the step's
        penalties.Penalties), draws from the warped q as `draw_from` does (the keyed DRAFT uniforms,
        or a pathwise request's Gumbel-max with the uploaded noise lanes; greedy: the argmax), and
        a sequence stops where `propose` would: before an unusable (non-finite) row, after a token
        below the confidence threshold. Its later forwards still run (their K/V are rolled back);
        what they draw is past num_draft."""
        if staged.proposal is not None:  # (drafted on the host: `stage`)
            return super().run_staged(seqs, staged, sent, penalties)
        p, B, K = staged.inputs, len(seqs), len(staged.forwards)
        device = self.runner.device
        tokens = torch.zeros(B, K, dtype=torch.int64, device=device)  # [B, K]
        num_draft = sent[p + "num_draft"].clone()  # [B]
        greedy = all(s.params.greedy for s in seqs)
        probs = None if greedy else torch.zeros(B, K + 1, self.vocab_size, device=device)  # [B, K+1, V]
        carry = None
        for prepared, args in staged.ahead:  # a long catch-up's first pieces (their logits are unused)
            self.runner.run(prepared, **args)
        for i, (active, prepared, args) in enumerate(staged.forwards):
            rows = sent[f"{p}rows{i}"]  # [A]
            if i == 0:
                out = self.runner.run(prepared, **args)
            else:
                keep = sent[f"{p}keep{i}"]
                out = self.runner.run(prepared, drawn=tokens[rows, i - 1], **self.chain_args(None if carry is None else carry[keep]))
            logits, carry = self.split(out)  # [A, V_d], the carry or None
            if penalties is not None:
                logits = self.adjust_staged(logits, penalties, rows, tokens[rows, :i])
            logits, ok = drop_nonfinite(logits)
            if greedy:
                drawn = logits.argmax(-1)  # [A]
            else:
                warp = WarpParams.of([seqs[b].params for b in active], logits.shape[-1], device,
                                     {name: sent[f"{p}warp{i}.{name}"] for name in WARP_DTYPES})
                q = warp_probs(logits, warp)  # [A, V_d]
                drawn = sample(q, sent[f"{p}u{i}"])  # [A]
                if f"{p}pathwise{i}" in sent:
                    chosen = sent[f"{p}pathwise{i}"]  # [P_i]
                    drawn[chosen] = lane_gumbel_max(q[chosen], sent[f"{p}noise{i}"], self.draft_ids)
                if self.draft_ids is None:
                    probs[rows, i] = q
                else:  # 0 outside the draft's vocabulary
                    probs[rows[:, None], i, self.draft_ids[None, :]] = q
            tokens[rows, i] = drawn if self.draft_ids is None else self.draft_ids[drawn]
            stop = torch.where(ok, num_draft[rows], i)  # [A]: before an unusable row
            if self.confidence_threshold is not None:  # after an unsure token (`draw`'s test)
                own = logits.float().softmax(-1).gather(-1, drawn[:, None]).squeeze(-1)  # [A]
                stop = torch.where(ok & (own < self.confidence_threshold), i + 1, stop)
            live = num_draft[rows] > i  # [A] still drafting
            num_draft[rows] = torch.where(live, torch.minimum(stop, num_draft[rows]), num_draft[rows])
        if probs is not None:
            probs *= (torch.arange(K + 1, device=device)[None, :] < num_draft[:, None])[..., None]
        return Drafts(tokens, num_draft, probs)

    def adjust_staged(self, logits: torch.Tensor, penalties: Penalties, rows: torch.Tensor,
                      drafted: torch.Tensor) -> torch.Tensor:
        """`adjust` on the device, in `run_staged`: draft logits [A, V_d] of batch rows rows [A],
        each penalised with its sequence's tokens (penalties: their counts on the device) and its
        drafts so far, drafted [A, i] (target ids), as the target's verification row there is."""
        A, depth = drafted.shape
        before = torch.zeros(A, self.vocab_size, device=logits.device)  # [A, V]: the drafts' counts
        before.scatter_add_(1, drafted, torch.ones(A, depth, device=logits.device))
        at = torch.full((A,), depth, device=logits.device)  # [A] drafts before each row
        if self.draft_ids is None:
            return penalties.apply(logits, rows, before, at)
        full = logits.new_full((A, self.vocab_size), float("-inf"))  # [A, V]
        full[:, self.draft_ids] = logits
        return penalties.apply(full, rows, before, at)[:, self.draft_ids]
