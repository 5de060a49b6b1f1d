"""What the host tier (``host_tier.py``) keeps and answers: a state saved out of the KV
(:class:`SavedState`, the runner's bytes for positions ``0 .. n-1`` of one token path, in RAM,
on disk or both), the longest prefix of a prompt a saved state covers (:class:`HostMatch`),
the match a cache acts on when a state covers more than its own tree (:class:`TieredMatch`),
and when content about to be lost is worth saving (:func:`worth_saving`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotserve.engine.prefix_cache.state_directory import DiskEntry
from slotserve.engine.prefix_cache.tree_node import Match, TreeNode

# Content about to be lost is saved only when at least this many tokens go, and at least one
# in this many of the path's (a state is the whole path: a short tail of a long path is cheaper
# to compute again than to copy).
MIN_SAVED_TOKENS = 16
MAX_PATH_PER_LOST_TOKEN = 64


@dataclass(eq=False)
class SavedState:
    """One sequence state: the runner's bytes for the positions of its node's path, in RAM
    (``data``), in a file (``on_disk``) or both."""

    data: bytearray | None
    on_disk: DiskEntry | None = None


HostNode = TreeNode[SavedState | None]


@dataclass(frozen=True)
class HostMatch:
    """The longest prefix of a prompt some saved state covers: ``length`` tokens, restorable
    from the state at ``leaf`` (the smallest one covering them)."""

    leaf: HostNode
    length: int


@dataclass(frozen=True)
class TieredMatch(Match[Any]):
    """A match that a saved state covers further than the cache's tree does: ``length``
    tokens from ``saved``, of which ``in_tree`` (ending at ``node``) are in the tree."""

    in_tree: int = 0
    saved: HostMatch | None = None


def worth_saving(lost_tokens: int, path_tokens: int) -> bool:
    """Whether a path of ``path_tokens`` whose last ``lost_tokens`` would otherwise be gone is
    worth saving as a whole."""
    return lost_tokens >= max(MIN_SAVED_TOKENS, path_tokens // MAX_PATH_PER_LOST_TOKEN)
