"""The shared pool of KV blocks: free queue, reference counts and the prefix-cache hash index.

Invariants:
- a block is in the free queue iff its ref count is 0;
- free blocks that hold a cached (hashed) full block sit at the back of the queue in the order they
  were released, so allocation evicts the least recently used cached block first; free blocks with no
  hash sit at the front and are reused before any cached block is evicted;
- a hash maps to at most one block, and a block carries at most one hash.
"""

from __future__ import annotations

from collections import OrderedDict


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` slots hold ``a`` tokens."""
    return -(-a // b)


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the pool has free."""


class BlockPool:
    """Fixed-size KV blocks with O(1) allocate / free and ref counts."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_keys: list[object] = [None] * num_blocks  # what was hashed, to rule out collisions
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Hand out ``num`` blocks with ref count 1, evicting least recently used cached blocks if needed."""
        if num > len(self._free):
            raise NoFreeBlocksError(f"asked for {num} blocks, {len(self._free)} free of {self.num_blocks}")
        block_ids = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            self._drop_hash(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a fork)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero return to the free queue.

        Blocks are released last-first, so a request's tail blocks are evicted before its head.
        """
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was referenced")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
                if self.block_hashes[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    # --- prefix cache ---------------------------------------------------------------------------

    def lookup(self, block_hash: int, key: object = None) -> int | None:
        """The block holding the full block with this hash (and, if given, this exact key), or None."""
        block_id = self._cached.get(block_hash)
        if block_id is not None and key is not None and self.block_keys[block_id] != key:
            return None  # a hash collision: not the same content
        return block_id

    def set_hash(self, block_id: int, block_hash: int, key: object = None) -> None:
        """Record that ``block_id`` now holds the full block with ``block_hash`` (first writer wins)."""
        if self.block_hashes[block_id] is not None or block_hash in self._cached:
            return
        self.block_hashes[block_id] = block_hash
        self.block_keys[block_id] = key
        self._cached[block_hash] = block_id

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            self.block_hashes[block_id] = None
            self.block_keys[block_id] = None
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block_id in range(self.num_blocks):
            self.block_hashes[block_id] = None
            self.block_keys[block_id] = None
        self._cached.clear()

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks
