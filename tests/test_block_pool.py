"""Block pool: ids handed out, ref counts, free order, prefix-cache index and eviction order."""

import pytest

from hfpaged.core.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_hands_out_lowest_ids_first_with_ref_count_one():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.ref_counts[:6] == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 5


def test_freed_uncached_blocks_are_reused_first_in_the_same_order():
    pool = BlockPool(8)
    first = pool.allocate(3)
    pool.free(first)
    assert pool.num_free_blocks == 8
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]


def test_ref_counts_through_incref_and_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    assert pool.ref_counts[:2] == [2, 2]
    pool.free(blocks)
    assert pool.ref_counts[:2] == [1, 1]
    assert pool.num_free_blocks == 2
    pool.free(blocks)
    assert pool.ref_counts[:2] == [0, 0]
    assert pool.all_free()


def test_double_free_raises():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks)


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks, 1 free of 3"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_cached_blocks_are_evicted_least_recently_released_first_and_tail_first():
    pool = BlockPool(6)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    for block_id, h in zip(a + b, [10, 11, 20, 21]):
        pool.set_hash(block_id, h)
    pool.free(a)  # released tail first: 1 then 0
    pool.free(b)  # then 3, 2
    # uncached free blocks (4, 5) go first, then cached ones in release order
    assert pool.allocate(2) == [4, 5]
    assert pool.allocate(1) == [1]
    assert pool.lookup(11) is None  # evicted: its hash is dropped
    assert pool.lookup(10) == 0
    assert pool.allocate(3) == [0, 3, 2]
    assert pool.lookup(10) is None and pool.lookup(20) is None and pool.lookup(21) is None


def test_incref_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(3)
    blocks = pool.allocate(1)
    pool.set_hash(blocks[0], 99)
    pool.free(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.lookup(99)
    pool.incref([hit])
    assert pool.num_free_blocks == 2
    assert pool.ref_counts[hit] == 1
    assert pool.allocate(2) == [1, 2]


def test_first_writer_wins_for_a_hash():
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    pool.set_hash(x, 5)
    pool.set_hash(y, 5)
    assert pool.lookup(5) == x
    assert pool.block_hashes[y] is None
