"""The block pool's fresh blocks: made when first reached (the free queue's order unchanged), and
the resident bound (`resident_blocks`): freed blocks reused before fresh ones once that many
blocks have been written."""

from __future__ import annotations

import random

import pytest

from loom.block_hash import hash_block_tokens
from loom.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from loom.core.kv_cache_manager import KVCacheManager
from loom.request import Request
from loom.sampling_params import SamplingParams


def test_a_big_pool_makes_only_the_blocks_it_reaches() -> None:
    pool = BlockPool(100_000, enable_caching=True)
    assert len(list(pool.blocks.made())) == 1  # the null block
    assert pool.get_num_free_blocks() == 99_999 and pool.num_touched_blocks == 0
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert [b.block_id for b in pool.free_block_queue.peek(2)] == [4, 5]  # made, not taken
    assert len(list(pool.blocks.made())) == 6
    assert pool.get_num_free_blocks() == 99_996 and pool.num_touched_blocks == 3
    assert pool.blocks[50_000].block_id == 50_000 and pool.blocks[50_000] is pool.blocks[50_000]


@pytest.mark.parametrize("seed", range(5))
def test_lazy_queue_orders_blocks_as_a_queue_of_all_blocks(seed: int) -> None:
    """Random pops, appends, appendlefts and removes: the fresh run gives the same ids, in the
    same order, as a queue that held every block from the start."""
    n, rng = 40, random.Random(seed)
    eager = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(1, n + 1)])
    made: dict[int, KVCacheBlock] = {}
    lazy = FreeKVCacheBlockQueue((), fresh=range(1, n + 1),
                                 make=lambda i: made.setdefault(i, KVCacheBlock(i)))
    held: list[tuple[KVCacheBlock, KVCacheBlock]] = []
    for _ in range(400):
        op = rng.random()
        if (op < 0.45 or not held) and len(eager):
            held.append((eager.popleft(), lazy.popleft()))
        elif op < 0.7:
            e, z = held.pop(rng.randrange(len(held)))
            eager.append(e), lazy.append(z)
        elif op < 0.9:
            e, z = held.pop(rng.randrange(len(held)))
            eager.appendleft(e), lazy.appendleft(z)
        else:  # a prefix hit revives a block freed before from the middle of the queue
            queued = [z for z in made.values() if z.prev_free_block is not None]
            if queued:
                z = rng.choice(queued)
                e = next(b for b in eager.get_all_free_blocks() if b.block_id == z.block_id)
                eager.remove(e), lazy.remove(z)
                held.append((e, z))
        assert all(e.block_id == z.block_id for e, z in held)
        assert len(eager) == len(lazy)
        assert [b.block_id for b in eager.peek(5)] == [b.block_id for b in lazy.peek(5)]
    assert ([b.block_id for b in eager.get_all_free_blocks()]
            == [b.block_id for b in lazy.get_all_free_blocks()])


def _cache_one(pool: BlockPool, tokens: list[int]) -> KVCacheBlock:
    """Take a block, cache it as holding `tokens`, free it: a prefix-cached idle block."""
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [hash_block_tokens(None, tokens)], tokens, 0, 1, len(tokens))
    pool.free_blocks([block])
    return block


def test_resident_bound_reuses_cached_blocks_before_fresh_ones() -> None:
    bounded = BlockPool(50, enable_caching=True, resident_blocks=4)
    unbounded = BlockPool(50, enable_caching=True)
    for i in range(10):
        _cache_one(bounded, [i, i])
        _cache_one(unbounded, [i, i])
    assert unbounded.num_touched_blocks == 10 and len(unbounded.cached_block_hash_to_block) == 10
    # Bounded: blocks 1-4 written, then reused least recently freed first (their cache evicted)
    assert bounded.num_touched_blocks == 4
    assert len(bounded.cached_block_hash_to_block) == 4
    assert bounded.get_cached_block(hash_block_tokens(None, [9, 9])) is not None
    assert bounded.get_cached_block(hash_block_tokens(None, [5, 5])) is None
    assert bounded.get_num_free_blocks() == unbounded.get_num_free_blocks() == 49


def test_resident_bound_gives_fresh_blocks_when_the_written_ones_are_in_use() -> None:
    pool = BlockPool(20, enable_caching=False, resident_blocks=4)
    held = pool.get_new_blocks(6)  # more in use than the bound: fresh blocks, no refusal
    assert [b.block_id for b in held] == [1, 2, 3, 4, 5, 6]
    pool.free_blocks(reversed(held))
    again = pool.get_new_blocks(6)
    assert sorted(b.block_id for b in again) == [1, 2, 3, 4, 5, 6]  # reused, none fresh
    assert pool.num_touched_blocks == 6
    assert len(pool.get_new_blocks(13)) == 13 and pool.get_num_free_blocks() == 0


def test_kv_cache_manager_bound_keeps_the_prefix_cache_within_it() -> None:
    kv = KVCacheManager(num_blocks=200, block_size=4, enable_caching=True, max_model_len=64,
                        resident_blocks=8)
    for i in range(20):  # 20 requests of 9 tokens (3 blocks), one after the other
        req = Request(f"r{i}", [100 * i + t for t in range(9)], SamplingParams(max_tokens=1))
        blocks, hit = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, 9 - hit, blocks, hit) is not None
        kv.free(req)
        kv.check_integrity()
    assert kv.block_pool.num_touched_blocks <= 8 + 2  # the bound, passed by one allocation
    again = Request("again", [1900 + t for t in range(9)], SamplingParams(max_tokens=1))
    assert kv.get_computed_blocks(again)[1] == 8  # the newest prompt still hits


def test_integrity_check_of_a_big_pool_makes_no_fresh_block_and_still_catches_a_leak() -> None:
    """check_integrity runs after every failed step: on a 100k-block pool it must not build the
    blocks never handed out, and it still catches a block held by no request."""
    from loom.core.kv_cache_manager import KVCacheIntegrityError

    kv = KVCacheManager(num_blocks=100_000, block_size=4, enable_caching=True, max_model_len=64)
    reqs = [Request(f"r{i}", [10 * i + t for t in range(9)], SamplingParams(max_tokens=1))
            for i in range(3)]
    for req in reqs:
        assert kv.allocate_slots(req, 9) is not None
    kv.free(reqs[0])
    made = len(list(kv.block_pool.blocks.made()))
    kv.check_integrity()
    assert len(list(kv.block_pool.blocks.made())) == made < 20
    kv.req_to_blocks[reqs[1].request_id].pop()  # a block the request no longer lists: leaked
    with pytest.raises(KVCacheIntegrityError, match="ref_cnt 1 but 0 requests hold it"):
        kv.check_integrity()
