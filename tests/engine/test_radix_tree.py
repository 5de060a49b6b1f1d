"""The radix tree on its own: splitting, matching, locking, LRU eviction, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.engine.prefix_cache.radix_tree import RadixTree
from slotserve.engine.prefix_cache.tree_node import TreeNode, common_prefix_length


def _split_list(value: list[int], k: int) -> tuple[list[int], list[int]]:
    return value[:k], value[k:]


def _tree() -> RadixTree[list[int]]:
    """Handles are lists with one entry per token (like a paged runner's block ids)."""
    return RadixTree(list, _split_list)


def _insert(tree: RadixTree[list[int]], tokens: list[int]) -> TreeNode[list[int]]:
    node = tree.insert(tokens)
    if not node.value and node is not tree.root:
        node.value = [1000 + t for t in node.key]
    return node


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length(list(range(1000)), [*range(777), 0]) == 777


def test_partial_match_splits_the_edge_on_insert() -> None:
    tree = _tree()
    _insert(tree, [1, 2, 3, 4, 5])
    node = _insert(tree, [1, 2, 3, 9])
    assert tree.path_tokens(node) == [1, 2, 3, 9]
    upper = node.parent
    assert upper is not None and upper.key == [1, 2, 3] and sorted(upper.children) == [4, 9]
    assert upper.children[4].key == [4, 5]
    # The split divides the handle between the two halves.
    assert upper.value == [1001, 1002, 1003] and upper.children[4].value == [1004, 1005]
    assert tree.total_tokens == 6 and tree.num_nodes == 3
    tree.check_integrity()


def test_match_returns_the_longest_prefix_even_inside_an_edge() -> None:
    tree = _tree()
    _insert(tree, [1, 2, 3, 4, 5])
    match = tree.match_prefix([1, 2, 3, 7])
    assert match.length == 3 and match.node.key == [1, 2, 3, 4, 5]  # matched partly, not split
    assert tree.num_nodes == 1
    assert tree.match_prefix([9]).length == 0
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).length == 5


def test_insert_of_an_existing_prefix_returns_its_node_without_new_tokens() -> None:
    tree = _tree()
    leaf = _insert(tree, [1, 2, 3])
    assert tree.insert([1, 2, 3]) is leaf
    assert tree.insert([]) is tree.root
    assert tree.total_tokens == 3


def test_eviction_goes_least_recently_used_first() -> None:
    tree = _tree()
    _insert(tree, [1, 1])
    _insert(tree, [2, 2])
    _insert(tree, [3, 3])
    tree.match_prefix([1, 1])  # now [2, 2] is the least recently used
    evicted: list[list[int]] = []
    freed = tree.evict(2, lambda node: evicted.append(tree.path_tokens(node)))
    assert freed == 2 and evicted == [[2, 2]]
    tree.evict(2, lambda node: evicted.append(tree.path_tokens(node)))
    assert evicted == [[2, 2], [3, 3]]
    tree.check_integrity()


def test_the_eviction_heap_kept_across_calls_follows_later_touches() -> None:
    tree = _tree()
    for first in range(1, 6):
        _insert(tree, [first, first])
    evicted: list[list[int]] = []
    tree.evict(2, lambda node: evicted.append(tree.path_tokens(node)))  # [1, 1]: oldest
    tree.match_prefix([2, 2])  # touched after the heap was built: now the newest
    _insert(tree, [3, 3, 7])  # [3, 3] gains a child: no longer a leaf
    tree.evict(4, lambda node: evicted.append(tree.path_tokens(node)))
    assert evicted == [[1, 1], [4, 4], [5, 5]]
    tree.evict(100, lambda node: evicted.append(tree.path_tokens(node)))
    # The insert touched [3, 3] after [2, 2]; the parent goes once its last child went.
    assert evicted[3:] == [[2, 2], [3, 3, 7], [3, 3]]
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_eviction_removes_leaves_before_their_parents() -> None:
    tree = _tree()
    _insert(tree, [1, 2, 3])
    _insert(tree, [1, 2, 4])
    order: list[list[int]] = []
    tree.evict(100, lambda node: order.append(tree.path_tokens(node)))
    assert len(order) == 3 and order[-1] == [1, 2]
    assert tree.total_tokens == 0 and tree.num_nodes == 0


def test_locked_nodes_and_their_ancestors_survive_eviction() -> None:
    tree = _tree()
    kept = _insert(tree, [1, 2, 3])
    _insert(tree, [1, 2, 4, 5])
    _insert(tree, [7, 8])
    tree.lock(kept)
    assert tree.evictable_tokens == 4  # [4, 5] and [7, 8]
    tree.evict(1000, lambda node: None)
    assert tree.match_prefix([1, 2, 3]).length == 3
    assert tree.total_tokens == 3 and tree.evictable_tokens == 0
    tree.unlock(kept)
    assert tree.evictable_tokens == 3
    tree.evict(1000, lambda node: None)
    assert tree.total_tokens == 0
    tree.check_integrity()


def test_a_split_under_a_lock_keeps_the_lock_on_both_halves() -> None:
    tree = _tree()
    node = _insert(tree, [1, 2, 3, 4])
    tree.lock(node)
    _insert(tree, [1, 2, 9])
    assert node.parent is not None and node.parent.lock_ref == 1
    tree.check_integrity()
    tree.unlock(node)
    tree.check_integrity()


def test_unlock_without_lock_is_refused() -> None:
    tree = _tree()
    node = _insert(tree, [1])
    with pytest.raises(RuntimeError):
        tree.unlock(node)


def test_prune_removes_a_leaf_without_kv_and_empty_ancestors() -> None:
    tree: RadixTree[set[int]] = RadixTree(set, lambda v, k: (set(), v))
    a = tree.insert([1, 2, 3])
    a.value.add(0)
    b = tree.insert([1, 2, 4])
    b.value.add(1)
    b.value.clear()
    assert tree.prune(b) == 1  # [4] goes; [1, 2] still leads to a held node
    assert tree.num_nodes == 2
    a.value.clear()
    assert tree.prune(a) == 3
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_integrity_check_catches_a_bad_counter() -> None:
    tree = _tree()
    _insert(tree, [1, 2])
    tree.total_tokens += 1
    with pytest.raises(AssertionError, match="tokens"):
        tree.check_integrity()


_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=8),
        st.integers(0, 12),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_random_operations_keep_the_tree_consistent(
    ops: list[tuple[str, list[int], int]],
) -> None:
    tree = _tree()
    inserted: set[tuple[int, ...]] = set()
    locked: list[tuple[TreeNode[list[int]], tuple[int, ...]]] = []
    evicted: list[tuple[int, ...]] = []

    def record(node: TreeNode[list[int]]) -> None:
        assert node.lock_ref == 0 and node.is_leaf
        # Eviction only removes whole leaves, so the handle covers the evicted tokens.
        assert len(node.value) == len(node.key)
        evicted.append(tuple(tree.path_tokens(node)))

    for op, tokens, amount in ops:
        if op == "insert":
            _insert(tree, tokens)
            inserted.add(tuple(tokens))
        elif op == "match":
            match = tree.match_prefix(tokens)
            assert tree.path_tokens(match.node)[: match.length] == tokens[: match.length]
            if tuple(tokens) in inserted:
                assert match.length == len(tokens)
        elif op == "lock":
            node = _insert(tree, tokens)
            inserted.add(tuple(tokens))
            tree.lock(node)
            locked.append((node, tuple(tokens)))
        elif op == "unlock" and locked:
            node, _ = locked.pop(amount % len(locked))
            tree.unlock(node)
        elif op == "evict":
            evicted.clear()
            before = tree.total_tokens
            freed = tree.evict(amount, record)
            assert tree.total_tokens == before - freed
            # The heap kept across calls never misses a candidate: short only when nothing
            # unlocked is left.
            assert freed >= amount or tree.evictable_tokens == 0
            for path in evicted:
                inserted = {p for p in inserted if p[: len(path)] != path}
        tree.check_integrity()
        for _, path in locked:  # locked prefixes are never evicted
            assert tree.match_prefix(list(path)).length == len(path)
