"""How a tree step lays its trees out for the target, shared by the step on the host
(speculative_tree.py) and on the device (tree_on_device.py).

One verification forward feeds each sequence its uncached tokens (the root, its last token, last)
and then its tree's nodes: node i at key index L + i and position L - 1 + depth(i), attending to
the cached prefix, the root and its own ancestors only (the tree mask of
kernels/paged_attention.py). In the flat logits, sequence b's root row comes first and node i's
row is the root's + 1 + i. The layout decides nothing about which token is emitted (the walk
does, from these rows), so both steps share it as it is.
"""

from __future__ import annotations

from .drafters.draft_tree import DraftTree
from .runtime.runner import Feed, TreeFeed
from .runtime.sequence import Sequence


def tree_offsets(trees: list[DraftTree]) -> list[int]:
    """Each sequence's root row in the flat verification logits (node i: root row + 1 + i), and the total."""
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + len(t) + 1)
    return offsets


def first_rejected(tree: DraftTree, path: list[int]) -> list[int]:
    """What a step reports as drafted past its accepted path (for traces and stream events):
    the draft's first choice below the path's end, which the target rejected; none at a leaf."""
    children = tree.children()[path[-1] + 1 if path else 0]
    return [tree.tokens[children[0]]] if children else []


def tree_feed(s: Sequence, tree: DraftTree) -> Feed:
    """The verification feed of one sequence: its uncached tokens (the root last), then the nodes
    at key indices len(s) + i, positions len(s) - 1 + depth, with their ancestor masks."""
    prefix = s.tokens[s.target_table.num_cached :]
    if not tree.tokens:
        return Feed(s.target_table, prefix)
    cached, root = s.target_table.num_cached, len(s) - 1
    mask = TreeFeed(len(s), list(range(cached, len(s))) + [root + d for d in tree.depths()],
                    [0] * len(prefix) + tree.ancestor_bits())
    return Feed(s.target_table, prefix + tree.tokens, len(tree) + 1, mask)


def placeholder_feed(s: Sequence, n: int) -> Feed:
    """`tree_feed` for a tree of n nodes drafted on the device: the nodes are drawn tokens, each a
    child of the root until the device writes its position and mask row."""
    prefix = s.tokens[s.target_table.num_cached :]
    if n == 0:
        return Feed(s.target_table, prefix)
    mask = TreeFeed(len(s), list(range(s.target_table.num_cached, len(s))) + [len(s)] * n,
                    [0] * len(prefix) + [1 << i for i in range(n)])
    return Feed(s.target_table, prefix + [0] * n, n + 1, mask, drawn=n)
