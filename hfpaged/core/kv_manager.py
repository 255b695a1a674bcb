"""The one owner of KV blocks: the GPU pool, the prefix cache, shared blocks and copy-on-write, swap space.

The scheduler asks (``allocate``, ``free``, ``fork``, ``share``, ``swap_out``/``swap_in``, ``lookup_prefix``)
and never touches block ids or reference counts itself. Block tables are kept per request id here; the
runner hears of changes through ``take_table_update`` (the part of a table that changed since it last
asked), so it can keep its own copy up to date by diffs.

Copy-on-write: the block a request is about to write into must be its own. When it is shared (a fork:
parallel samples, beams), a fresh block replaces it in the table and a (source, target) copy is queued
for the runner to perform before the forward (``take_copies``). A request released before its copy ran
cancels it: the source stands in for the target (``_cancel_copies``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import BlockPool, cdiv
from .prefix_cache import PrefixCache

if TYPE_CHECKING:
    from .request import Request


class KVManager:
    """Blocks of every request: GPU block tables, CPU swap blocks, prefix-cache hashes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        counters: dict[str, int] | None = None,
    ):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        self.counters = counters if counters is not None else {}
        for key in ("prefix_cache_queries", "prefix_cache_hits"):
            self.counters.setdefault(key, 0)
        self._blocks: dict[str, list[int]] = {}  # request id -> GPU block table
        self._cpu_blocks: dict[str, list[int]] = {}  # request id -> CPU blocks while swapped out
        self._hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # leading blocks published to the prefix cache
        # requests whose KV (GPU or swapped out) was computed before the last reset_prefix_cache (old weights):
        # none of their blocks is ever published, the later ones attend over the old K/V too
        self._stale: set[str] = set()
        self._changed_from: dict[str, int] = {}  # first table index changed since take_table_update
        self._copies: list[tuple[int, int]] = []  # copy-on-write (source, target) for the next step

    # --- queries ----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included)."""
        return self.pool.num_free_blocks

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (empty when it holds no GPU blocks)."""
        return self._blocks.get(request.request_id, [])

    def cpu_block_ids(self, request: Request) -> list[int]:
        return self._cpu_blocks.get(request.request_id, [])

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def all_free(self) -> bool:
        return self.pool.all_free() and (self.cpu_pool is None or self.cpu_pool.all_free())

    # --- GPU blocks -------------------------------------------------------------------------------

    def lookup_prefix(self, request: Request) -> list[int]:
        """Cached blocks that can stand for the request's leading tokens (none without prefix caching)."""
        if self.prefix_cache is None:
            return []
        hashes = self._hashes.setdefault(request.request_id, [])
        return self.prefix_cache.find_hits(request.all_token_ids, hashes, request.num_tokens, request.cache_salt)

    def allocate(
        self, request: Request, num_tokens: int, keep_free: int = 0, prefix_hits: list[int] | None = None
    ) -> bool:
        """Give ``request`` blocks for its first ``num_tokens`` positions if the pool has them, leaving at
        least ``keep_free`` free; False (and nothing changed) otherwise.

        ``prefix_hits`` (admission of a request holding no blocks): cached blocks taken for its leading tokens.
        Otherwise the block it writes next (at ``num_computed_tokens``) is copied first when it is shared.
        """
        rid = request.request_id
        pool = self.pool
        if prefix_hits is not None:
            needed = self.blocks_for(num_tokens) - len(prefix_hits)
            revived = sum(1 for block_id in prefix_hits if pool.ref_counts[block_id] == 0)
            if pool.num_free_blocks - revived - needed < keep_free:
                return False
            pool.incref(prefix_hits)
            self._blocks[rid] = list(prefix_hits) + pool.allocate(needed)
            self._num_registered[rid] = len(prefix_hits)
            self._changed_from[rid] = 0
            if self.prefix_cache is not None:
                self.counters["prefix_cache_queries"] += request.num_tokens
                self.counters["prefix_cache_hits"] += len(prefix_hits) * self.block_size
            return True
        blocks = self._blocks.get(rid)
        if blocks is None:
            blocks = self._blocks[rid] = []
        needed = max(0, cdiv(num_tokens, self.block_size) - len(blocks))
        write_index = request.num_computed_tokens // self.block_size
        shared = write_index < len(blocks) and pool.ref_counts[blocks[write_index]] > 1
        if needed + shared == 0:  # the usual decode: room in its own last block
            return True
        if pool.num_free_blocks - needed - shared < keep_free:
            return False
        changed = len(blocks)
        if shared:
            old = blocks[write_index]
            (new,) = pool.allocate(1)
            self._copies.append((old, new))
            blocks[write_index] = new
            pool.free([old])
            changed = write_index
        blocks.extend(pool.allocate(needed))
        self._changed_from[rid] = min(self._changed_from.get(rid, changed), changed)
        return True

    def room_check(self):
        """``has_room(request, start, end)``: True when ``allocate(request, end)`` would change nothing (its blocks
        hold positions up to ``end`` and the one written at ``start`` (its ``num_computed_tokens``, < ``end``) is
        its own): the usual decode, checked without allocate's call (~0.8 us a request, 256 a step)."""
        blocks_of, block_size, ref_counts = self._blocks, self.block_size, self.pool.ref_counts

        def has_room(request: Request, start: int, end: int) -> bool:
            blocks = blocks_of.get(request.request_id)
            return bool(blocks) and end <= len(blocks) * block_size and ref_counts[blocks[start // block_size]] <= 1

        return has_room

    def free(self, request: Request, keep_hashes: bool = False) -> None:
        """Release the request's GPU and CPU blocks (its hashes too, unless it will be recomputed)."""
        rid = request.request_id
        blocks = self._cancel_copies(rid)
        self._blocks.pop(rid, None)  # first: a failure inside pool.free leaks, rather than the recovery freeing twice
        if blocks:
            self.pool.free(blocks)
        cpu = self._cpu_blocks.pop(rid, None)
        if cpu:
            self.cpu_pool.free(cpu)
        self._num_registered.pop(rid, None)
        self._changed_from.pop(rid, None)
        self._stale.discard(rid)  # gone, or recomputed from scratch with the current weights
        if not keep_hashes:
            self._hashes.pop(rid, None)

    def fork(self, child: Request, parent: Request) -> None:
        """``child`` shares every block of ``parent`` (one more reference each); their common last block,
        if partly filled, is copied on write by whichever writes into it first."""
        blocks = self.block_ids(parent)
        self.pool.incref(blocks)
        cid = child.request_id
        self._blocks[cid] = list(blocks)
        self._hashes[cid] = list(self._hashes.get(parent.request_id, []))
        self._num_registered[cid] = self._num_registered.get(parent.request_id, 0)
        self._changed_from[cid] = 0
        if parent.request_id in self._stale:
            self._stale.add(cid)

    def share(self, targets: list[Request], sources: list[Request]) -> None:
        """Each ``targets[j]`` takes over the blocks of ``sources[j]`` (beam search: beam j continues it).

        The new references are taken before the targets' old blocks are released, so a block some target
        keeps is never freed in between; blocks no target keeps return to the pool.
        """
        taken = [
            (
                list(self.block_ids(s)),
                list(self._hashes.get(s.request_id, [])),
                self._num_registered.get(s.request_id, 0),
                s.request_id in self._stale,
            )
            for s in sources
        ]
        for blocks, _, _, _ in taken:
            self.pool.incref(blocks)
        for target, (blocks, hashes, num_registered, stale) in zip(targets, taken):
            tid = target.request_id
            self.pool.free(self._blocks.get(tid, []))
            self._blocks[tid] = blocks
            self._hashes[tid] = hashes
            self._num_registered[tid] = num_registered
            self._changed_from[tid] = 0
            (self._stale.add if stale else self._stale.discard)(tid)

    def register_computed(self, request: Request) -> None:
        """Publish the request's blocks that became full and computed since the last call."""
        if self.prefix_cache is None:
            return
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if not blocks or rid in self._stale:
            return
        full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        start = self._num_registered.get(rid, 0)
        if full <= start:
            return
        hashes = self._hashes.setdefault(rid, [])
        self.prefix_cache.register(request.all_token_ids, hashes, blocks, start, full, request.cache_salt)
        self._num_registered[rid] = full

    def reset_prefix_cache(self) -> None:
        """Forget every published block (their contents are stale, e.g. the weights changed); the requests that
        hold K/V now never publish any block."""
        self.pool.reset_prefix_cache()
        self._stale.update(self._blocks)
        self._stale.update(self._cpu_blocks)
        self._hashes.clear()
        for rid in self._num_registered:
            self._num_registered[rid] = 0

    # --- swap space -------------------------------------------------------------------------------

    def swap_out(self, request: Request) -> tuple[list[int], list[int]] | None:
        """Move the request's blocks to CPU swap space: ``(gpu ids, cpu ids)`` to copy, or None if it has no room.

        Its GPU blocks go back to the pool at once: the copy runs at the start of the next forward, before
        anything can write into them again.
        """
        blocks = self.block_ids(request)
        if self.cpu_pool is None or self.cpu_pool.num_free_blocks < len(blocks):
            return None
        rid = request.request_id
        gpu_ids = self._cancel_copies(rid)
        cpu_ids = self.cpu_pool.allocate(len(blocks))
        self.pool.free(gpu_ids)
        self._blocks.pop(rid, None)
        self._num_registered.pop(rid, None)
        self._changed_from.pop(rid, None)
        self._cpu_blocks[rid] = cpu_ids
        return gpu_ids, cpu_ids

    def swap_in(self, request: Request, num_tokens: int, keep_free: int = 0) -> tuple[list[int], list[int]] | None:
        """GPU blocks for a swapped-out request's first ``num_tokens`` positions: ``(cpu ids, gpu ids)`` to copy
        back, or None when the pool lacks them. Its CPU blocks are free again once the copy has run."""
        rid = request.request_id
        cpu_ids = self._cpu_blocks[rid]
        needed = max(self.blocks_for(num_tokens), len(cpu_ids))
        if self.pool.num_free_blocks - needed < keep_free:
            return None
        gpu_ids = self.pool.allocate(needed)
        self._blocks[rid] = gpu_ids
        self._changed_from[rid] = 0
        self.cpu_pool.free(cpu_ids)  # the copy runs before any later swap-out can reuse them
        del self._cpu_blocks[rid]
        return cpu_ids, gpu_ids[: len(cpu_ids)]

    # --- what the runner must hear of -------------------------------------------------------------

    def take_table_update(self, request: Request) -> tuple[int, list[int]] | None:
        """``(start, block ids from start)`` when the table changed since the last call, else None."""
        start = self._changed_from.pop(request.request_id, None)
        if start is None:
            return None
        return start, self._blocks.get(request.request_id, [])[start:]

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (source, target) pairs queued since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def _cancel_copies(self, rid: str) -> list[int]:
        """The blocks that hold request ``rid``'s KV now, cancelling its queued copies-on-write: a target
        goes back to the pool with the request (and may be handed out again this step), and the source of
        the copy stands in for it."""
        blocks = list(self._blocks.get(rid, []))
        if not self._copies or not blocks:
            return blocks
        owned = set(blocks)
        source_of = {dst: src for src, dst in self._copies if dst in owned}
        if not source_of:
            return blocks
        self._copies = [(src, dst) for src, dst in self._copies if dst not in source_of]
        # the source block keeps the reference the target had
        sources = [source_of[b] for b in blocks if b in source_of]
        self.pool.incref(sources)
        self.pool.free([b for b in blocks if b in source_of])
        result = [source_of.get(b, b) for b in blocks]
        self._blocks[rid] = result
        return result
