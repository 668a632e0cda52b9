"""vLLM's options on a tree step laid out for the device: penalties, min_tokens and logprobs,
in the step's one upload and one download (tree_on_device.py `device_tree_step`).

The twin on the host is speculative_tree.py's `host_tree_step`: `penalized_tree` penalises the
root's row with the sequence's tokens and node i's row with them plus the tokens of its path
(the root's child down to i, i included: the tokens before the position its row predicts), and
`top_logprobs` reads the raw rows of the accepted path (the root's, then each path node's).

Penalties and min_tokens (`penalized_tree_on_device`). The sequence's part is the chain's:
penalties.py `Penalties`, each sequence's counts kept on the device and grown by the tokens the
upload carries. The path's part is made on the device from the trees (which may be searched
there): for every node, its own token and each ancestor's are added to its row's counts by
walking up the parents D times (one scatter-add of B * N ones per level), and a row is masked
for min_tokens while its depth (the path's tokens before the position it predicts) is below
min_left. Both are the host's history for that row, fed to the same formula
(`penalty_logits`), so every row's penalised logits are the host's, bit for bit, and the walk
(tree_walk_on_device.py) decides on them as the host walk does: the law is the penalised
target's, as speculative_tree.py shows for any tree. The draft's tree ignores penalties on the
device as on the host (any tree is exact).

Logprobs (`tree_logprobs_on_device`). The accepted path's rows of the RAW logits (before
penalties and the warp, as vLLM's), gathered with the path the walk found, through the chain's
`logprobs_of_rows`: top-n, the emitted token's logprob and rank, packed into the one download.
They only report: no emitted token depends on them. tests/test_tree_options_on_device.py checks
the two steps give the same tokens, counts and logprobs.

Memory: the path's counts are a [B, N+1, V] fp32 tensor, the penalised rows another [B, N+1, V]
in the logits' dtype, and `penalty_logits` makes a few temporaries of that shape, all freed
within the step; logprobs take [L, D+1, V] fp32 for the L requests that ask.
"""

from __future__ import annotations

import torch

from .penalties import Penalties
from .runtime.sequence import Sequence
from .runtime.transfers import Upload
from .verification_options import logprob_rows, logprobs_of_rows

Slices = list[tuple[int, int, int, int]]


def stage_tree_options(upload: Upload, seqs: list[Sequence], vocab_size: int) -> Slices | None:
    """The step's options into its upload: the penalties (`Penalties.stage`: factors, min_left,
    stop tokens and each sequence's new tokens) when a request adjusts its logits, and
    tree.logprob_rows [L] (the batch rows asking for logprobs). Returns the new tokens' slices
    (for `Penalties.from_upload`), or None when no request adjusts its logits."""
    asking = logprob_rows(seqs)
    if asking:
        upload.add("tree.logprob_rows", asking)  # [L]
    return Penalties.stage(upload, seqs, vocab_size)


def path_counts(tokens: torch.Tensor, parents: torch.Tensor, depth: int, vocab_size: int
                ) -> torch.Tensor:
    """Each slot's path counts [B, N+1, V] fp32 from the trees' tokens, parents [B, N] (parents
    first; -1 the root's child, -2 padding): slot 0 (the root) counts nothing, slot 1 + i counts
    node i's token and each of its ancestors' tokens, the path before the position its row
    predicts. Found by walking up `depth` levels (at least the deepest node's depth), one
    scatter-add of B * N ones a level: the [B, N, N] path mask times a one-hot [N, V] without
    making the one-hot."""
    B, N = tokens.shape
    counts = torch.zeros(B, N + 1, vocab_size, device=tokens.device)  # [B, N+1, V]
    node = torch.arange(N, device=tokens.device).expand(B, N)  # [B, N] each row's node on its path
    live = parents >= -1  # [B, N]: a real node (padding counts nothing)
    for _ in range(depth):
        at = node.clamp(min=0)
        counts[:, 1:].scatter_add_(-1, tokens.gather(1, at)[..., None], live[..., None].float())
        node = parents.gather(1, at)  # [B, N] one level up
        live = live & (node >= 0)
    return counts


def penalized_tree_on_device(target_logits: torch.Tensor, penalties: Penalties, tokens: torch.Tensor,
                             parents: torch.Tensor, slot_depth: torch.Tensor, depth: int
                             ) -> torch.Tensor:
    """`penalized_tree` on the device: target_logits [B, N+1, V] each slot's verification row
    (slot 0 the root's, 1 + i node i's), penalised with its sequence's counts (penalties) plus
    its path's (`path_counts`); min_tokens masks the stop tokens of a row whose slot_depth
    [B, N+1] (the path's tokens before the position the row predicts) is below the sequence's
    min_left."""
    B, slots, V = target_logits.shape
    before = path_counts(tokens, parents, depth, V)  # [B, N+1, V]
    batch_rows = torch.arange(B, device=target_logits.device)[:, None].expand(B, slots)  # [B, N+1]
    out = penalties.apply(target_logits.flatten(0, 1), batch_rows.flatten(), before.flatten(0, 1),
                          slot_depth.flatten())
    return out.view(B, slots, V)


def tree_logprobs_on_device(logits: torch.Tensor, sent: dict[str, torch.Tensor], path: torch.Tensor,
                            emitted: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor]:
    """`top_logprobs` of the accepted path on the device, for the L sequences that asked
    (tree.logprob_rows [L]): the raw logits [R, V]; path [B, D] the walk's nodes (-1 past it);
    emitted [B, D+1] the step's tokens. Position j's row is the root's for j = 0, then the
    row of the path's (j-1)-th node (past the path, the root's again: never emitted). Returns
    `logprobs_of_rows`'s four tensors for the step's download (unpacked by `host_logprobs`)."""
    chosen = sent["tree.logprob_rows"]  # [L]
    slots = torch.cat([path.new_zeros(len(path), 1), path + 1], dim=1)  # [B, D+1] (-1 + 1: the root)
    rows = sent["tree.rows"].gather(1, slots)  # [B, D+1] flat logits rows
    return logprobs_of_rows(logits, rows[chosen], emitted[chosen], seqs)
