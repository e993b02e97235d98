"""A radix tree over token ids, one tree per namespace, whose checkpoint nodes carry bundle ids.

A namespace is any hashable value, in practice (model id, cache_salt): the same tokens under two
namespaces never match each other. Each edge stores the exact token tuple it covers, and lookups
compare tokens (never hashes alone), so a hit is always an exact token prefix of the prompt.

Shape of a tree: the root covers zero tokens; a node's `edge` holds the tokens between its parent
and itself. The tree stays compact: apart from the root, every node either carries a bundle id
or has at least two children. Edges are split where an insert diverges, and a removal prunes
branches that no longer lead to a checkpoint and merges a node left with a single child.

Costs: insert, longest_prefix and remove are O(number of tokens), independent of how many
checkpoints a namespace holds. The index is pure bookkeeping: it owns no blocks and no tensors;
pinning and eviction live in the checkpoint ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cache.checkpoint_keys import Namespace

BundleId = int


@dataclass(frozen=True)
class Match:
    """The longest checkpoint whose tokens are a prefix of a lookup's tokens."""

    bundle_id: BundleId
    num_tokens: int


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]  # tokens from the parent to this node; empty only for the root
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # keyed by the child's first edge token
    bundle_id: BundleId | None = None


@dataclass(eq=False)
class _Tree:
    root: _Node
    num_checkpoints: int = 0
    num_nodes: int = 0  # excluding the root


class RadixIndex:
    def __init__(self) -> None:
        self._trees: dict[Namespace, _Tree] = {}
        self._endpoints: dict[BundleId, tuple[Namespace, _Node]] = {}

    # ---- lookups (change nothing) -------------------------------------------------------------

    def longest_prefix(self, namespace: Namespace, token_ids: Sequence[int]) -> Match | None:
        """The checkpoint with the most tokens whose token ids are a prefix of `token_ids`.

        A checkpoint covering all of `token_ids` matches. None when no checkpoint of this
        namespace is a prefix (or `token_ids` is empty). Changes nothing.
        """
        tree = self._trees.get(namespace)
        if tree is None:
            return None
        tokens = tuple(token_ids)
        node, pos, best = tree.root, 0, None
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            end = pos + len(child.edge)
            if end > len(tokens) or tokens[pos:end] != child.edge:
                break
            node, pos = child, end
            if node.bundle_id is not None:
                best = Match(node.bundle_id, pos)
        return best

    def get(self, namespace: Namespace, token_ids: Sequence[int]) -> BundleId | None:
        """The bundle id registered at exactly `token_ids`, or None. Changes nothing."""
        match = self.longest_prefix(namespace, token_ids)
        if match is None or match.num_tokens != len(token_ids):
            return None
        return match.bundle_id

    def __contains__(self, bundle_id: BundleId) -> bool:
        return bundle_id in self._endpoints

    def __len__(self) -> int:
        """Number of checkpoints over all namespaces."""
        return len(self._endpoints)

    def namespaces(self) -> list[Namespace]:
        """Namespaces that hold at least one checkpoint."""
        return list(self._trees)

    def num_checkpoints(self, namespace: Namespace) -> int:
        tree = self._trees.get(namespace)
        return 0 if tree is None else tree.num_checkpoints

    def num_nodes(self, namespace: Namespace) -> int:
        """Nodes held for this namespace, root excluded (compactness keeps it <= 2 x checkpoints)."""
        tree = self._trees.get(namespace)
        return 0 if tree is None else tree.num_nodes

    # ---- mutations -----------------------------------------------------------------------------

    def insert(
        self, namespace: Namespace, token_ids: Sequence[int], bundle_id: BundleId
    ) -> BundleId | None:
        """Register `bundle_id` as the checkpoint covering exactly `token_ids`.

        Returns None when it was registered: the tree may have gained a leaf and split one edge.
        Returns the existing bundle id when a checkpoint already sits at that exact endpoint: then
        nothing changed and the caller drops its duplicate. Raises ValueError for empty
        `token_ids` or a `bundle_id` that is already registered (nothing changed either way).
        """
        tokens = tuple(token_ids)
        if not tokens:
            raise ValueError("a checkpoint covers at least one token")
        if bundle_id in self._endpoints:
            raise ValueError(f"bundle {bundle_id} is already in the index")
        existing = self.get(namespace, tokens)
        if existing is not None:
            return existing
        tree = self._trees.get(namespace)
        if tree is None:
            tree = self._trees[namespace] = _Tree(_Node((), None))
        node, pos = tree.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(tokens[pos:], node)
                node.children[tokens[pos]] = leaf
                tree.num_nodes += 1
                node, pos = leaf, len(tokens)
                break
            shared = _common_prefix_len(child.edge, tokens, pos)
            if shared < len(child.edge):
                child = self._split(tree, child, shared)
            node, pos = child, pos + shared
        node.bundle_id = bundle_id
        tree.num_checkpoints += 1
        self._endpoints[bundle_id] = (namespace, node)
        return None

    def remove(self, namespace: Namespace, bundle_id: BundleId) -> bool:
        """Drop the checkpoint `bundle_id` of `namespace`; True if it was there.

        Prunes nodes that no longer lead to a checkpoint, merges a node left with one child into
        it, and forgets the namespace when its last checkpoint goes. False (nothing changed) when
        the bundle is not registered under this namespace.
        """
        where = self._endpoints.get(bundle_id)
        if where is None or where[0] != namespace:
            return False
        del self._endpoints[bundle_id]
        tree = self._trees[namespace]
        node = where[1]
        node.bundle_id = None
        tree.num_checkpoints -= 1
        self._compact(tree, node)
        if tree.num_checkpoints == 0:
            assert not tree.root.children and tree.num_nodes == 0
            del self._trees[namespace]
        return True

    def remove_endpoint(self, namespace: Namespace, token_ids: Sequence[int]) -> BundleId | None:
        """Drop the checkpoint at exactly `token_ids`; returns its bundle id, or None if none."""
        bundle_id = self.get(namespace, token_ids)
        if bundle_id is not None:
            self.remove(namespace, bundle_id)
        return bundle_id

    # ---- tree surgery ----------------------------------------------------------------------------

    @staticmethod
    def _split(tree: _Tree, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens (0 < at < len(edge)); returns the new middle node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.edge)
        middle = _Node(child.edge[:at], parent)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        tree.num_nodes += 1
        return middle

    @staticmethod
    def _compact(tree: _Tree, node: _Node) -> None:
        """Restore compactness after `node` lost its bundle id."""
        while node is not tree.root and node.bundle_id is None and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.edge[0]]
            tree.num_nodes -= 1
            node = parent
        if node is not tree.root and node.bundle_id is None and len(node.children) == 1:
            parent = node.parent
            assert parent is not None
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = parent
            parent.children[child.edge[0]] = child
            tree.num_nodes -= 1


def _common_prefix_len(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:].

    Compares tuple slices (C loops) and bisects to the first mismatch: a lookup walks prompts
    of thousands of tokens on the request's path to its first token, where a token-by-token
    Python loop cost about a millisecond (benchmarks/ttft_anatomy.py, its restore profile)."""
    limit = min(len(edge), len(tokens) - start)
    matched, end = 0, limit  # edge[:matched] matches; the first mismatch, if any, is before end
    while end - matched > 16:
        middle = (matched + end) // 2
        if edge[matched:middle] == tokens[start + matched:start + middle]:
            matched = middle
        else:
            end = middle
    while matched < limit and edge[matched] == tokens[start + matched]:
        matched += 1
    return matched
