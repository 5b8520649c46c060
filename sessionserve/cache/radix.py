"""Radix prefix cache over whole pages.

Finished requests insert their KV here so later requests with the same prefix (a shared system
prompt, a retried turn) reuse it. Only whole pages are stored: a node's key length is a multiple
of `page_size`, so every stored slot belongs to a page the tree owns entirely.

Ownership: the tree owns the slots of its nodes and is the only one that frees them (`evict`,
`flush`). A node with `lock_ref > 0` (locked by a running request or a session slot, through any
descendant) is *protected*: never evicted. Every other node is *evictable*.
Lock references survive node splits: a split puts a new parent above the locked node with the
same `lock_ref`, so a saved node stays valid and `unlock` walks the new path.

Eviction keeps its heap of evictable leaves between calls while nothing else touched the tree:
a busy replica with a full pool evicts a page at each page its decodes open (two a step at 32
requests, page 16), and a heap rebuilt from every node each time cost ~0.8 ms a step on an
H100's host (docs/benchmarks.md). Any match, insert, lock or unlock drops it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sessionserve.cache.allocator import PagedAllocator, ceil_align, floor_align
from sessionserve.errors import DoubleFreeError

_clock = itertools.count(1)


@dataclass(eq=False)
class RadixNode:
    key: list[int]
    slots: torch.Tensor
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def __lt__(self, other: RadixNode) -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


class PrefixMatch(NamedTuple):
    slots: torch.Tensor  # [matched_len] KV slots of the matched prefix
    node: RadixNode  # deepest matched node: lock it to keep `slots` alive

    @property
    def length(self) -> int:
        return self.slots.numel()


class RadixCache:
    def __init__(self, allocator: PagedAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.enabled = enabled
        self.root = RadixNode(key=[], slots=torch.empty(0, dtype=torch.int64))
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        # the evictable leaves, LRU first, as the last `evict` left them; None once anything
        # else changed the tree (an access stamp, a new leaf, a lock): rebuilt from the nodes
        self._eviction_heap: list[RadixNode] | None = None

    # ---- sizes (tokens) ----
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- match / insert ----
    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest page-aligned cached prefix of `tokens`; splits a node where the match ends."""
        node, parts = self._walk(tokens) if self.enabled else (self.root, [])
        empty = torch.empty(0, dtype=torch.int64)
        return PrefixMatch(torch.cat(parts) if parts else empty, node)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Insert the page-aligned part of `tokens` with their `slots`.

        Returns how many leading tokens were already cached: the tree keeps its own slots for
        those, so the caller still owns (and must free or swap) its duplicates in that range.
        Slots beyond the returned length now belong to the tree.
        """
        n = floor_align(len(tokens), self.page_size)
        if not self.enabled or n == 0:
            return 0
        node, parts = self._walk(tokens[:n])
        existing = sum(p.numel() for p in parts)
        if existing < n:
            leaf = RadixNode(
                key=list(tokens[existing:n]),
                slots=slots[existing:n].clone(),
                parent=node,
                last_access=next(_clock),
            )
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += n - existing
        return existing

    # ---- locks ----
    def lock(self, node: RadixNode) -> None:
        self._eviction_heap = None
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        self._eviction_heap = None
        while node is not self.root:
            if node.lock_ref <= 0:
                raise DoubleFreeError("radix unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    # ---- eviction ----
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` from unlocked leaves, least recently used first.

        A leaf longer than what is still needed gives up only its last pages: a conversation
        the tree holds loses its end first and keeps its beginning for a returning turn (a
        prefix cache that frees blocks tail first does the same). Not with sliding-window
        layers kept apart: a cut prefix's window would be gone, so there whole leaves go.
        Returns the tokens actually freed (page-aligned, so possibly more; less if too little
        is evictable). Evicting 0 is always safe.
        """
        if num_tokens <= 0:
            return 0
        heap = self._eviction_heap
        if heap is None:
            heap = [n for n in self._iter_nodes() if not n.children and n.lock_ref == 0]
            heapq.heapify(heap)
        freed = 0
        trim = self.allocator.sliding is None
        while heap and freed < num_tokens:
            leaf = heapq.heappop(heap)
            short = ceil_align(num_tokens - freed, self.page_size)
            if trim and short < len(leaf.key):
                freed += self._trim_leaf(leaf, len(leaf.key) - short)
                heapq.heappush(heap, leaf)  # still a leaf, as recently used as before
                break
            freed += self._delete_leaf(leaf)
            parent = leaf.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        self._eviction_heap = heap  # exactly the evictable leaves again
        return freed

    def flush(self) -> int:
        """Evict everything unlocked; returns tokens freed."""
        return self.evict(self._evictable)

    # ---- internals ----
    def _child_key(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _walk(self, tokens: Sequence[int]) -> tuple[RadixNode, list[torch.Tensor]]:
        """Follow `tokens` down the tree page by page; returns the deepest node and slot parts."""
        self._eviction_heap = None  # stamps and splits change the order and the leaves
        node, parts, pos, stamp = self.root, [], 0, next(_clock)
        node.last_access = stamp
        while pos + self.page_size <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + self.page_size]))
            if child is None:
                break
            m = self._match_len(child.key, tokens, pos)  # >= one page: the child key matched
            partial = m < len(child.key)
            if partial:
                child = self._split(child, m)
            child.last_access = stamp
            parts.append(child.slots)
            pos += m
            node = child
            if partial:
                break
        return node, parts

    def _match_len(self, key: list[int], tokens: Sequence[int], start: int) -> int:
        n = min(len(key), len(tokens) - start)
        i = 0
        while i < n and key[i] == tokens[start + i]:
            i += 1
        return floor_align(i, self.page_size)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Put a new node holding `child.key[:at]` between child and its parent."""
        parent = child.parent
        head = RadixNode(
            key=child.key[:at],
            slots=child.slots[:at],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        parent.children[self._child_key(head.key)] = head
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], head
        head.children[self._child_key(child.key)] = child
        return head

    def _trim_leaf(self, leaf: RadixNode, keep: int) -> int:
        """Free a leaf's slots past `keep` (page-aligned, > 0); the leaf stays, shorter."""
        self.allocator.free(leaf.slots[keep:])
        cut = len(leaf.key) - keep
        leaf.key, leaf.slots = leaf.key[:keep], leaf.slots[:keep]
        self._evictable -= cut
        return cut

    def _delete_leaf(self, leaf: RadixNode) -> int:
        self.allocator.free(leaf.slots)
        del leaf.parent.children[self._child_key(leaf.key)]
        self._evictable -= len(leaf.key)
        return len(leaf.key)

    def nodes(self):
        """Every node but the root (for the memory checker)."""
        return self._iter_nodes()

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
