"""Which pool blocks hold a tree node's positions in the paged prefix cache (``paged_cache.py``):
a node's :class:`BlockSpan`, how splitting an edge divides it, and the blocks a path gives a
slot.

Nodes end at any token, not only at block boundaries, so a node's first block may also be its
parent's last (both hold it)::

    positions   0 ........ 15 | 16 ...... 31 | 32 ... 47
    node A  [0, 20)   blocks  b4             b9
    node B  [20, 40)  blocks                 b9'          b2      (B's writer copied b9
                                                                   before writing at 20)

A match assembles a slot's table from the deepest node covering each block (its copy holds the
positions before it too: whoever wrote the node's first token had them in that block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from slotserve.engine.prefix_cache.tree_node import TreeNode


@dataclass
class BlockSpan:
    """The blocks holding a node's positions ``start ..`` (up to the node's end)."""

    start: int = 0
    blocks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:  # a leaf without blocks holds no KV
        return bool(self.blocks)


def node_span(node: TreeNode[BlockSpan], table: Sequence[int], block_size: int) -> BlockSpan:
    """The blocks of a slot's ``table`` holding ``node``'s positions."""
    first, end = node.start // block_size, -(-node.end // block_size)
    return BlockSpan(node.start, list(table[first:end]))


def split_span(span: BlockSpan, k: int, block_size: int) -> tuple[BlockSpan, BlockSpan]:
    """Divides a node's blocks at its ``k``-th token; a block holding both sides' positions
    goes to both (the caller holds it once more)."""
    first, cut = span.start // block_size, span.start + k
    upper = BlockSpan(span.start, span.blocks[: -(-cut // block_size) - first])
    lower = BlockSpan(cut, span.blocks[cut // block_size - first :])
    return upper, lower


def path_blocks(node: TreeNode[BlockSpan], length: int, block_size: int) -> list[int]:
    """The blocks holding positions ``0 .. length - 1`` along the path to ``node``."""
    blocks = [-1] * -(-length // block_size)
    path = []
    walk: TreeNode[BlockSpan] | None = node
    while walk is not None and walk.parent is not None:
        path.append(walk)
        walk = walk.parent
    for step in reversed(path):  # deeper nodes overwrite a shared boundary block
        span = step.value
        first = span.start // block_size
        for offset, block in enumerate(span.blocks):
            if first + offset < len(blocks):
                blocks[first + offset] = block
    assert -1 not in blocks, "the path does not cover the match"
    return blocks


def check_span(node: TreeNode[BlockSpan], block_size: int) -> None:
    """Raises ``AssertionError`` unless ``node``'s span covers exactly its positions."""
    span = node.value
    assert span.start == node.start, f"span starts {span.start}, node {node.start}"
    expected_blocks = -(-node.end // block_size) - node.start // block_size
    assert len(span.blocks) == expected_blocks, f"node ending at {node.end}: blocks"
