"""Prefix caching for the serving engine: keys and values of token prefixes already computed, kept in fixed-size
blocks and copied into a new request's KV-cache slot, so that only the rest of its prompt is prefilled.

Design (the two known ones, Kwon et al. 2023 "Efficient Memory Management for Large Language Model Serving with
PagedAttention" with vLLM's automatic prefix caching, and Zheng et al. 2024 "SGLang: Efficient Execution of
Structured Language Model Programs", RadixAttention):

* **Blocks and keys** (vLLM): a prompt is cut into full blocks of ``block_size`` tokens; block ``j`` is keyed by a
  hash of its own tokens and the key of block ``j - 1`` (a hash chain), so a key names the whole prefix up to the
  end of its block, and two prompts share block ``j`` exactly when they share their first ``(j + 1) * block_size``
  tokens. The first key also hashes a *namespace* (the LoRA adapter serving the request), since the same tokens
  under another adapter have other keys and values. A partial last block is never cached. Keys are Python hashes;
  each block also stores its tokens and a lookup compares them, so a hash collision is a miss, never a wrong hit.
* **Tree and eviction** (SGLang): the blocks form a tree (each block's parent is the block before it). A block's
  reference count is the number of cached blocks that extend it plus the running requests that hold it (a request
  holds the blocks of its prompt from admission until it ends). Only unreferenced blocks (leaves nobody holds) are
  evicted, least recently used first (a lookup or an insert counts as a use of every block on the path), so a
  chain is always evicted from its end and every cached block stays reachable from the root.
* **Budget**: at most ``budget_bytes`` of blocks (``2 * n_layers * n_kv_heads * block_size * head_dim`` elements
  each); blocks are allocated when inserted and freed when evicted. When nothing can be evicted, new blocks are
  simply not cached.

Unlike vLLM, the engine's attention reads one contiguous slot per request (:class:`~minigpt.infer.kv_cache.
SlotKVCache`), not the blocks themselves: a hit *copies* the blocks into the slot (a memory copy of ``n`` tokens
instead of a forward over them), and after a prefill the new full blocks are copied out of the slot.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Optional, Sequence

import torch

from minigpt.infer.kv_cache import SlotKVCache

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size


def block_hashes(tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, namespace: int = 0,
                 start: int = 0, previous: Optional[list[int]] = None) -> list[int]:
    """Keys of the full blocks of ``tokens``: ``key_j = hash((key_{j-1}, tokens of block j))`` with
    ``key_{-1} = ("prefix", namespace)``. ``previous``: the keys of the first ``start`` blocks, already computed
    (extended, not recomputed)."""
    keys = list(previous or [])[:start]
    prev = keys[-1] if keys else hash(("prefix", namespace))
    for j in range(len(keys), len(tokens) // block_size):
        prev = hash((prev, tuple(tokens[j * block_size:(j + 1) * block_size])))
        keys.append(prev)
    return keys


def shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading keys two block-key chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Block:
    """One cached block: its key, tokens, parent, keys/values ``[n_layers, n_kv_heads, block_size, head_dim]``,
    reference count and last use."""

    __slots__ = ("key", "tokens", "parent", "k", "v", "refs", "stamp")

    def __init__(self, key: int, tokens: tuple[int, ...], parent: Optional["Block"], k: torch.Tensor,
                 v: torch.Tensor) -> None:
        self.key, self.tokens, self.parent, self.k, self.v = key, tokens, parent, k, v
        self.refs = 0
        self.stamp = 0


class PrefixCache:
    """Reference-counted, LRU-evicted KV blocks keyed by token-prefix hashes (see the module docstring).

    Args:
        n_layers, n_kv_heads, head_dim, dtype, device: those of the engine's :class:`SlotKVCache`.
        budget_bytes: the most bytes of blocks held (keys and values); less than one block caches nothing.
        block_size: tokens per block.

    Owners (the engine's request ids) hold blocks through :meth:`match` and :meth:`insert` and give them back
    with :meth:`release`. Not thread-safe: the engine's worker is its only user.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None, budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.shape = (n_layers, n_kv_heads, block_size, head_dim)
        self.dtype, self.device = dtype, device
        self.block_bytes = 2 * n_layers * n_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype
                                                                                           ).element_size()
        self.budget_bytes = budget_bytes
        self.capacity = max(0, budget_bytes // self.block_bytes)  # blocks
        self._blocks: dict[int, Block] = {}
        self._held: dict[int, dict[int, Block]] = {}  # owner -> {key: block}
        self._lru: list[tuple[int, int]] = []  # heap of (stamp, key) of unreferenced blocks; stale entries skipped
        self._clock = itertools.count(1)
        self.evictions = 0

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def n_blocks(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        """Bytes the cached blocks take."""
        return len(self._blocks) * self.block_bytes

    def hashes(self, tokens: Sequence[int], namespace: int = 0) -> list[int]:
        """:func:`block_hashes` with this cache's block size."""
        return block_hashes(tokens, self.block_size, namespace)

    def peek(self, tokens: Sequence[int], keys: Sequence[int]) -> int:
        """How many leading blocks of ``tokens`` (block keys ``keys``) are cached; changes nothing."""
        n = 0
        for j, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None or block.tokens != tuple(tokens[j * self.block_size:(j + 1) * self.block_size]):
                break
            n += 1
        return n

    def match(self, tokens: Sequence[int], keys: Sequence[int], owner: int) -> list[Block]:
        """The longest run of cached blocks that starts ``tokens`` (block keys ``keys``), held by ``owner`` and
        marked used."""
        found = [self._blocks[key] for key in keys[:self.peek(tokens, keys)]]
        for block in found:
            self._hold(owner, block)
            self._touch(block)
        return found

    # ------------------------------------------------------------------------------------------------ copies
    def load(self, blocks: Sequence[Block], cache: SlotKVCache, slot: int) -> int:
        """Copy ``blocks`` (a chain from the root) into columns ``0 .. len(blocks) * block_size`` of ``slot``;
        returns the number of tokens copied."""
        b = self.block_size
        for j, block in enumerate(blocks):
            cache.k[:, slot, :, j * b:(j + 1) * b] = block.k
            cache.v[:, slot, :, j * b:(j + 1) * b] = block.v
        return len(blocks) * b

    def insert(self, tokens: Sequence[int], keys: Sequence[int], cache: SlotKVCache, slot: int, owner: int) -> int:
        """Cache the full blocks of ``tokens`` (whose keys and values are columns ``0 .. len(tokens)`` of ``slot``;
        block keys ``keys``, at least one per full block), held by ``owner``. Blocks already cached are only marked
        used; a new block evicts least recently used unreferenced ones to fit the budget and is skipped, with
        everything after it, when none can go. Returns the number of blocks now cached along ``tokens``."""
        b = self.block_size
        parent: Optional[Block] = None
        n_full = min(len(tokens) // b, len(keys))
        for j in range(n_full):
            key, span = keys[j], tuple(tokens[j * b:(j + 1) * b])
            block = self._blocks.get(key)
            if block is not None and (block.tokens != span or block.parent is not parent):
                return j  # a hash collision: leave the other prefix alone
            if block is None:
                if not self._make_room():
                    return j
                k = cache.k[:, slot, :, j * b:(j + 1) * b].clone()
                v = cache.v[:, slot, :, j * b:(j + 1) * b].clone()
                block = Block(key, span, parent, k, v)
                self._blocks[key] = block
                if parent is not None:
                    parent.refs += 1
            self._hold(owner, block)
            self._touch(block)
            parent = block
        return n_full

    # ------------------------------------------------------------------------------------------------ owners
    def release(self, owner: int) -> None:
        """``owner`` no longer holds its blocks (they become evictable when nothing else references them)."""
        for block in self._held.pop(owner, {}).values():
            self._unref(block)

    def clear(self) -> None:
        """Drop every unheld block."""
        while self._evict_one():
            pass

    # ------------------------------------------------------------------------------------------------ internals
    def _hold(self, owner: int, block: Block) -> None:
        held = self._held.setdefault(owner, {})
        if block.key not in held:
            held[block.key] = block
            block.refs += 1

    def _unref(self, block: Block) -> None:
        block.refs -= 1
        if block.refs == 0:
            self._push(block)

    def _touch(self, block: Block) -> None:
        block.stamp = next(self._clock)
        if block.refs == 0:
            self._push(block)

    def _push(self, block: Block) -> None:
        heapq.heappush(self._lru, (block.stamp, block.key))
        if len(self._lru) > 4 * len(self._blocks) + 64:  # mostly stale entries: rebuild from the live blocks
            self._lru = [(b.stamp, b.key) for b in self._blocks.values() if not b.refs]
            heapq.heapify(self._lru)

    def _make_room(self) -> bool:
        while len(self._blocks) >= self.capacity:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        while self._lru:
            stamp, key = heapq.heappop(self._lru)
            block = self._blocks.get(key)
            if block is None or block.refs or block.stamp != stamp:
                continue  # stale entry: evicted already, referenced again, or used since
            del self._blocks[key]
            self.evictions += 1
            if block.parent is not None:
                self._unref(block.parent)
            return True
        return False

    def check(self) -> None:
        """Assert the invariants (tests): reference counts = children + holders, the budget, no orphan."""
        children: dict[int, int] = {}
        for block in self._blocks.values():
            if block.parent is not None:
                assert block.parent.key in self._blocks, "a block outlived its parent"
                children[block.parent.key] = children.get(block.parent.key, 0) + 1
        holders: dict[int, int] = {}
        for held in self._held.values():
            for key in held:
                holders[key] = holders.get(key, 0) + 1
        for key, block in self._blocks.items():
            assert block.refs == children.get(key, 0) + holders.get(key, 0), f"block {key}: refs {block.refs}"
        assert len(self._blocks) <= max(self.capacity, 0)


def tokens_in_slot(prompt: Sequence[int], output: Iterable[int], length: int) -> list[int]:
    """The tokens whose keys and values fill the first ``length`` columns of a request's slot: its prompt, then its
    generated tokens (the last sampled one is not in the cache yet)."""
    out = list(prompt)
    for t in output:
        if len(out) >= length:
            break
        out.append(t)
    return out[:length]
