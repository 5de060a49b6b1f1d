"""The radix tree's parts (``radix_tree.py``): a node, whose edge holds a run of token ids and
whose ``value`` is the owner's opaque handle to that run's KV; a match of a token list in the
tree; and how long two token lists agree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(eq=False)
class TreeNode(Generic[V]):
    key: list[int]  # the edge's tokens, from the parent to this node
    value: V
    parent: TreeNode[V] | None
    end: int  # tokens from the root through the end of this node's key
    children: dict[int, TreeNode[V]] = field(default_factory=dict)
    lock_ref: int = 0  # outstanding locks on this node and on its descendants
    last_access: int = 0

    @property
    def start(self) -> int:
        """Position of this node's first token in the prefix it spells."""
        return self.end - len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class Match(Generic[V]):
    """The longest cached prefix of a token list.

    ``length`` tokens matched; ``node`` is the deepest node touched, which may be matched only
    partly (``length < node.end``): its first ``length - node.start`` tokens matched.
    """

    node: TreeNode[V]
    length: int


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low
