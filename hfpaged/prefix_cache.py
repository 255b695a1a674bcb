"""Prefix caching: full blocks named by a hash of their tokens chained with their parent's hash.

A request's leading full blocks that some earlier request already computed are reused (ref count +1)
instead of recomputed. At most ``num_tokens - 1`` tokens are ever taken from the cache, so the last
token is always computed and there are logits to sample; a block a request is still writing is never
shared. Blocks become reusable once every token in them has been computed.
"""

from __future__ import annotations

from .block_pool import BlockPool
from .request import Request


class PrefixCache:
    """Hashing, lookup and registration of full blocks over one block pool."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size

    def _key(self, request: Request, index: int) -> tuple:
        bs = self.block_size
        parent = request.block_hashes[index - 1] if index > 0 else None
        return (parent, tuple(request.all_token_ids[index * bs : (index + 1) * bs]))

    def hash_full_blocks(self, request: Request) -> list[int]:
        """Extend ``request.block_hashes`` to every full block of its tokens; returns it."""
        hashes = request.block_hashes
        for index in range(len(hashes), len(request.all_token_ids) // self.block_size):  # known tokens only
            hashes.append(hash(self._key(request, index)))
        return hashes

    def find_hits(self, request: Request) -> list[int]:
        """Ids of the cached blocks that can stand for the request's leading tokens (not yet referenced)."""
        hashes = self.hash_full_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for index in range(min(max_blocks, len(hashes))):
            block_id = self.pool.lookup(hashes[index], self._key(request, index))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register(self, request: Request) -> None:
        """Publish the request's blocks that became full and computed since the last call."""
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_registered_blocks:
            return
        hashes = self.hash_full_blocks(request)
        for index in range(request.num_registered_blocks, full):
            self.pool.set_hash(request.block_ids[index], hashes[index], self._key(request, index))
        request.num_registered_blocks = full
