"""Prefix caching: full blocks named by a hash of their tokens chained with their parent's hash.

A request's leading full blocks that some earlier request already computed are reused (ref count +1)
instead of recomputed. At most ``num_tokens - 1`` tokens are ever taken from the cache, so the last
token is always computed and there are logits to sample; a block a request is still writing is never
shared. Blocks are published once every token in them has been computed. A request with a cache salt chains its
first block from the salt: its blocks are found only by requests with the same salt (a longrope model's long
prompts, whose keys are rotated otherwise at every position; vLLM's ``cache_salt`` works the same way).
"""

from __future__ import annotations

from .block_pool import BlockPool


class PrefixCache:
    """Hashing, lookup and registration of full blocks over one block pool."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size

    def _key(self, token_ids: list[int], hashes: list[int], index: int, salt: object = None) -> tuple:
        bs = self.block_size
        parent = hashes[index - 1] if index > 0 else salt
        return (parent, tuple(token_ids[index * bs : (index + 1) * bs]))

    def extend_hashes(self, token_ids: list[int], hashes: list[int], salt: object = None) -> list[int]:
        """Extend ``hashes`` (in place) to every full block of ``token_ids``; returns it."""
        for index in range(len(hashes), len(token_ids) // self.block_size):
            hashes.append(hash(self._key(token_ids, hashes, index, salt)))
        return hashes

    def find_hits(self, token_ids: list[int], hashes: list[int], num_tokens: int, salt: object = None) -> list[int]:
        """Ids of the cached blocks that can stand for the leading tokens (at most ``num_tokens - 1`` of them)."""
        self.extend_hashes(token_ids, hashes, salt)
        max_blocks = (num_tokens - 1) // self.block_size
        hits = []
        for index in range(min(max_blocks, len(hashes))):
            block_id = self.pool.lookup(hashes[index], self._key(token_ids, hashes, index, salt))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register(
        self, token_ids: list[int], hashes: list[int], block_ids: list[int], start: int, end: int, salt: object = None
    ) -> None:
        """Publish blocks ``[start, end)`` of a request (full and computed) under their hashes."""
        self.extend_hashes(token_ids, hashes, salt)
        for index in range(start, end):
            self.pool.set_hash(block_ids[index], hashes[index], self._key(token_ids, hashes, index, salt))
