"""Shared-prefix layout: a micro-batch's sequences as a radix tree, each shared prefix packed once.

Members of a group share their first prompt, every episode of a pack begins with the same system
and environment text, and a low-entropy policy's members often write the same responses. Laid
out flat, the decoder runs over each copy; laid out as a tree, over each distinct prefix once.

The tree's nodes are runs of tokens that a set of sequences share (a radix tree over the token
lists). Flattened in depth-first order, node i holds the tokens at depths [start, start + length)
of every sequence through it, at positions `start...`; its queries attend to the tokens of its
ancestors and, causally, to its own (docs/concepts.md section 5: a token sees exactly its own
sequence's earlier tokens, as in the flat layout). The hidden state of a shared position is the same
for every sequence through it, so the loss's per-segment rows are gathered from the tree with
repeats, in the flat layout's order: the loss, the gradients and every per-token value are those
of the flat layout (tests/data/test_prefix_sharing.py checks it in float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def unique_tokens(token_lists: list[list[int]]) -> int:
    """Tokens of the radix tree over `token_lists`: sum of lengths minus what sorted neighbours
    share (each list, inserted in sorted order, adds what it does not share with the previous)."""
    ordered = sorted(token_lists)
    return sum(len(t) - common_prefix(t, p) for p, t in zip([[], *ordered], ordered, strict=False))


@dataclass(frozen=True)
class Node:
    start: int
    """Depth of the node's first token in every sequence through it."""
    length: int
    parent: int
    """Index of the parent node, -1 for a root."""
    source: int
    """A sequence through the node (its tokens are source's [start, start + length))."""


@dataclass(frozen=True)
class Tree:
    nodes: list[Node]
    """Depth-first order: every parent before its children."""
    paths: list[list[int]]
    """Per sequence (input order), the node indices from its root to its end."""

    def offsets(self) -> list[int]:
        """Flattened position of each node's first token."""
        out, total = [], 0
        for node in self.nodes:
            out.append(total)
            total += node.length
        return out


def _breaks(k: int, lcp: list[int], length: int) -> list[int]:
    """Depths on sorted sequence k where some other sequence leaves its path: the running
    minima of the neighbour LCPs to either side (LCP(k, j) = min of lcp between them)."""
    depths = {0, length}
    low = length
    for j in range(k, 0, -1):  # sequences before k: lcp[j] = LCP(sorted j-1, sorted j)
        low = min(low, lcp[j])
        depths.add(low)
        if low == 0:
            break
    low = length
    for j in range(k + 1, len(lcp)):
        low = min(low, lcp[j])
        depths.add(low)
        if low == 0:
            break
    return sorted(depths)


def flat_tree(token_lists: list[list[int]]) -> Tree:
    """Every sequence a root of its own: the flat layout, nothing shared."""
    nodes = [Node(0, len(tokens), -1, i) for i, tokens in enumerate(token_lists)]
    return Tree(nodes, [[i] for i in range(len(token_lists))])


def build_tree(token_lists: list[list[int]]) -> Tree:
    """The radix tree over non-empty token lists (equal lists share every node)."""
    order = sorted(range(len(token_lists)), key=lambda i: token_lists[i])
    seqs = [token_lists[i] for i in order]
    lcp = [0] + [common_prefix(seqs[k - 1], seqs[k]) for k in range(1, len(seqs))]
    nodes: list[Node] = []
    paths: list[list[int]] = [[] for _ in token_lists]
    previous: dict[int, int] = {}  # end depth -> node, on the previous sorted sequence's path
    for k, tokens in enumerate(seqs):
        depths = _breaks(k, lcp, len(tokens))
        path, ends = [], {}
        for a, b in pairwise(depths):
            if k > 0 and b <= lcp[k]:  # shared with the previous sequence: its node
                node = previous[b]
            else:
                node = len(nodes)
                nodes.append(Node(a, b - a, path[-1] if path else -1, order[k]))
            path.append(node)
            ends[b] = node
        paths[order[k]] = path
        previous = ends
    return Tree(nodes, paths)
