"""The drafter interface, the drafter of plain decoding, and the one autoregressive draft loop.

A drafter proposes, for each sequence b of a step, up to num_draft[b] tokens and the draft
distribution q each was drawn from. `speculative_step` calls exactly these methods, in order:

    propose(seqs, num_draft) -> Proposal       before the target's verification
    observe(seqs, starts, num_fed, hidden)     after it, the target's features of the positions it
                                               was fed (only for a drafter with `target_layers`)
    rollback(seqs)                             after it: forget what the target rejected

and, outside the step, `feed_prompt(seqs, ends)` after the target was fed a chunk of each prompt
(runtime/chunked_prefill.py; `observe` then has its features already).

`target_layers` names the target layers whose input residual stream the drafter reads (an
EAGLE-3 head); for every other drafter it is empty and the target computes no features.

What a drafter remembers of a sequence between steps lives in `seq.draft_state`. It is None
when the sequence arrives and is set to None again when a preemption frees the sequence's pages
(`Sequence.preempted`, runtime/sequence.py), so None means: start over from the sequence's tokens and tables.

A tree drafter (`drafts_trees`, drafters/tree.py) proposes with `propose_trees` instead, one
`DraftTree` per sequence, and is verified by speculative_tree.py; observe and rollback are the same.
One that can search on the device lays its search out in the step's upload with `stage_trees`
and runs it with `run_staged_trees` (the default: None, it proposes on the host).

A new drafter is one file: a `Drafter` subclass, or an `AutoregressiveDrafter` subclass when a
model drafts token by token (it then supplies the forwards; the sampling loop is shared here).
"""

from __future__ import annotations

import torch

from ..core import drafters as core
from ..core.drafters import Proposal, draft_uniforms, drop_nonfinite
from ..pathwise import gumbel_max
from ..penalties import Penalties, penalize
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from ..runtime.transfers import Upload
from ..sampling import sample, warp_probs
from .draft_loop_on_device import DraftLoopOnDevice
from .staged import Drafts, Staged


class Drafter(core.Drafter):
    """The interface (see the module docstring); the defaults suit a drafter with no state."""

    def stage(self, seqs: list[Sequence], num_draft: list[int], upload: Upload) -> Staged:
        """Lay out this step's drafting in the step's one upload (runtime/transfers.py). A host
        drafter (n-gram, no drafter) proposes now: its tokens ride up with the upload."""
        proposal = self.propose(seqs, num_draft)
        prefix = upload.scope()
        K = max((len(d) for d in proposal.tokens), default=0)
        upload.add(prefix + "tokens", [d + [0] * (K - len(d)) for d in proposal.tokens])  # [B, K]
        upload.add(prefix + "num_draft", [len(d) for d in proposal.tokens])  # [B]
        return Staged([len(d) for d in proposal.tokens], proposal.tokens, [False] * len(seqs), inputs=prefix,
                      proposal=proposal)

    def run_staged(self, seqs: list[Sequence], staged: Staged, sent: dict[str, torch.Tensor],
                   penalties: Penalties | None = None) -> Drafts:
        """The device's half of `stage`, once the upload is sent (`sent`: its tensors); penalties:
        the step's penalties and min_tokens (penalties.py), for a drafter whose q applies them."""
        p = staged.inputs
        return Drafts(sent[p + "tokens"], sent[p + "num_draft"], staged.proposal.probs)

    target_layers: tuple[int, ...] = ()
    drafts_trees: bool = False  # proposes with propose_trees

    def propose_trees(self, seqs: list[Sequence], max_depth: list[int]) -> list:
        """A tree drafter's proposal: one drafters.draft_tree.DraftTree per sequence, at most max_depth[b] deep."""
        raise NotImplementedError

    def stage_trees(self, seqs: list[Sequence], max_depth: list[int], upload: Upload):
        """A tree drafter's search laid out in a step's upload to run on the device
        (drafters/tree.py `TreeDrafter.stage_trees`), or None: it proposes on the host."""
        return None

    def run_staged_trees(self, seqs: list[Sequence], staged, sent: dict[str, torch.Tensor]):
        """The device's half of `stage_trees`: drafters.tree_search_on_device.DeviceTrees."""
        raise NotImplementedError

    def tree_slots(self, depth: int) -> int:
        """A tree drafter's: the cache slots one step may write past a sequence, in any pool."""
        raise NotImplementedError

    def observe(self, seqs: list[Sequence], starts: list[int], num_fed: list[int], hidden: torch.Tensor) -> None:
        """hidden: [sum(num_fed), len(target_layers) * H], the target's features for the positions
        it was just fed (sequence b: starts[b] .. starts[b] + num_fed[b] - 1)."""

    def feed_prompt(self, seqs: list[Sequence], ends: list[int]) -> None:
        """The target was just fed a chunk of each sequence's prompt, up to position ends[b]
        (exclusive): a drafter that caches the tokens themselves may feed them now, so that its
        prefill comes in the same chunks as the target's. Nothing is drafted."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: nothing is drafted, so each step emits the target's own token."""

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> Proposal:
        return Proposal.empty(len(seqs))


class AutoregressiveDrafter(DraftLoopOnDevice, Drafter, core.DraftLoop):
    """A model that drafts one token per forward: the first forward catches up on what the draft
    has not seen, each later one feeds the token just drafted. Subclasses give the forwards; the
    loop is the core's (`DraftLoop.propose`), which samples each token from the request's warped q
    with its keyed randomness; here it adds penalties (`adjust`), pathwise draws and a confidence
    threshold (`draw`), a reduced vocabulary's columns, and the step laid out for one upload.

    With a confidence threshold it drafts adaptively: a sequence stops after a token the drafter
    itself gave probability < threshold (softmax at temperature 1), so k is only an upper bound
    (the dynamic draft length of HF's assisted generation). Exactness is unaffected: the decision
    to stop depends only on what was already drafted (so does stopping at a row whose logits are
    not finite: a broken draft lowers acceptance, never exactness).
    """

    runner: ModelRunner
    vocab_size: int  # the target's: the width of q
    draft_ids: torch.Tensor | None = None  # target id of each logit column (None: the columns are target ids)
    tree_root_offset: int = -1  # drafters/tree.py: the first forward's row for seq sits at position len(seq) + this

    def __init__(self, confidence_threshold: float | None = None):
        if confidence_threshold is not None and not 0 < confidence_threshold < 1:
            raise ValueError(f"draft confidence_threshold must be in (0, 1), got {confidence_threshold}")
        self.confidence_threshold = confidence_threshold

    def draftable(self, seq: Sequence, n: int) -> int:
        """How many of the n tokens asked for seq can be drafted now."""
        raise NotImplementedError

    def first_forward(self, seqs: list[Sequence], active: list[int]) -> tuple[torch.Tensor, object]:
        """Catch up sequences `active` and return (logits [len(active), V_d] of their next token, carry)."""
        raise NotImplementedError

    def next_forward(self, seqs: list[Sequence], active: list[int], tokens: list[list[int]], carry: object
                     ) -> tuple[torch.Tensor, object]:
        """Feed each active sequence its last drafted token; carry: the previous forward's, at those rows."""
        raise NotImplementedError

    def tree_forward(self, feeds: list, carry: object, rows: list[int]) -> tuple[torch.Tensor, object]:
        """Feed tree nodes (drafters/tree.py; `Feed`s with a `TreeFeed`): logits [R, V_d] of every
        fed node, and the carry for the next level; fed node i continues row rows[i] of `carry`."""
        raise NotImplementedError

    def next_logits(self, seqs: list[Sequence], active: list[int], drafted: list[list[int]]) -> torch.Tensor:
        """The core loop's forwards (core/drafters.py `DraftLoop.propose`): `first_forward` at
        depth 0, then `next_forward` with the previous forward's carry at the rows still drafting."""
        if not any(drafted[b] for b in active):  # depth 0: nothing drafted yet this step
            logits, self._carry = self.first_forward(seqs, active)
        else:
            carry = self._carry
            if isinstance(carry, torch.Tensor):
                row_of = {b: row for row, b in enumerate(self._active)}
                carry = carry[[row_of[b] for b in active]]
            logits, self._carry = self.next_forward(seqs, active, drafted, carry)
        self._active = active
        return logits

    @property
    def columns(self) -> slice | torch.Tensor:
        """The target ids of q's columns: a reduced vocabulary's (drafters/reduced_vocab.py), else all."""
        return slice(None) if self.draft_ids is None else self.draft_ids

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def first_feeds(self, seqs: list[Sequence], active: list[int]) -> tuple[list, dict]:
        """The feeds and model arguments of the first forward of a step (`first_forward`'s), after
        `feed_ahead`."""
        raise NotImplementedError

    def feed_ahead(self, seqs: list[Sequence], upload: Upload | None = None) -> list:
        """Before the first forward: a catch-up too long for one forward comes in pieces first.
        Without an upload they run now; with one they are prepared into it and returned as
        (prepared forward, model arguments), for `run_staged` to run in order. No pieces by default."""
        return []

    def split(self, out) -> tuple[torch.Tensor, object]:
        """A forward's output -> (logits [n, V_d], the carry for the next forward, or None)."""
        raise NotImplementedError

    def chain_args(self, carry: object) -> dict:
        """The model arguments of a chained forward, given the previous forward's carry at its rows."""
        return {}

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]]) -> torch.Tensor:
        """The requests' penalties and min_tokens (penalties.penalize) on draft logits [n, V_d],
        with the same history the target's verification row will see (the tokens so far and
        the drafts before this one). A draft vocabulary is lifted to the target's to apply them."""
        if not any(s.params.adjusts_logits for s in seqs):
            return logits
        rows = [s.penalty_row(d) for s, d in zip(seqs, drafted)]
        if self.draft_ids is None:
            return penalize(logits, rows)
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # [n, V]
        full[:, self.draft_ids] = logits
        return penalize(full, rows)[:, self.draft_ids]

    def draw(self, seqs: list[Sequence], active: list[int], logits: torch.Tensor, greedy: bool, depth: int
             ) -> tuple[list[int], list[bool], list[bool], torch.Tensor | None]:
        """One draft token per active row from logits [n, V_d], the draft at position len(s) + depth:
        (target ids, usable rows, rows confident enough to go on, q [n, V_d] or None when greedy),
        with one host copy. Each request draws by its rule (`draw_from`)."""
        logits, ok = drop_nonfinite(logits)  # [n, V_d], [n]; an unusable row's token is dropped
        q = None
        if greedy:
            drawn = logits.argmax(-1)  # [n]
        else:
            q = warp_probs(logits, [seqs[b].params for b in active])  # [n, V_d]
            drawn = draw_from(q, [seqs[b] for b in active], depth, self.draft_ids)  # [n]
        confident = None
        if self.confidence_threshold is not None:
            own = logits.float().softmax(-1).gather(-1, drawn[:, None]).squeeze(-1)  # [n]
            confident = own >= self.confidence_threshold
        ids = drawn if self.draft_ids is None else self.draft_ids[drawn]  # [n] target ids
        host = torch.stack([ids, ok.long()] + ([confident.long()] if confident is not None else [])).tolist()
        confident_rows = [bool(x) for x in host[2]] if confident is not None else [True] * len(host[0])
        return host[0], [bool(x) for x in host[1]], confident_rows, q


def draw_from(q: torch.Tensor, seqs: list[Sequence], depth: int, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """Row r's draft from q [n, V_d] (column j is target id draft_ids[j]; None: j itself), at
    position len(seqs[r]) + depth: by inverse CDF with the request's DRAFT uniform there (keyed by
    the step as well: randomness.py), or, for a pathwise request, by Gumbel-max with the target's
    own noise at that position (pathwise.py). Returns [n] int64 column indices."""
    drawn = sample(q, torch.tensor(draft_uniforms(seqs, depth), dtype=torch.float64, device=q.device))  # [n]
    pathwise = [r for r, s in enumerate(seqs) if s.pathwise]
    if pathwise:
        rows = torch.tensor(pathwise, device=q.device)
        drawn[rows] = gumbel_max(q[rows], [seqs[r].key for r in pathwise], [len(seqs[r]) + depth for r in pathwise], draft_ids)
    return drawn
