"""A drafted tree: what a tree drafter hands the tree step (speculative_tree.py) for one sequence.

Nodes in parents-first order, each a token whose parent is the root (the sequence's last token)
or an earlier node. The verification's rule is exact for any such tree fixed before the target's
random numbers are drawn (speculative_tree.py), so this is plain data: a drafter's host search
(drafters/tree.py), its search on the device (drafters/tree_search_on_device.py) or prompt
lookup's chain (drafters/lookup.py) all end in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    """Drafted tokens of one sequence as a tree, nodes in parents-first order: tokens[i] is node
    i's token, parents[i] its parent node (-1: a child of the root, the sequence's last token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        """A chain of drafts as a tree (prompt lookup's proposal)."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def depths(self) -> list[int]:
        """Depth of each node (1 for the root's children)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def ancestor_bits(self) -> list[int]:
        """The tree mask rows: bit j of row i is set when node j is node i or one of its ancestors."""
        out: list[int] = []
        for i, p in enumerate(self.parents):
            out.append((1 << i) | (0 if p < 0 else out[p]))
        return out

    def children(self) -> list[list[int]]:
        """children[0]: the root's children; children[i + 1]: node i's (in node order)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` (none for node -1, the root)."""
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]
