"""BlockPool, FreeKVCacheBlockQueue and block hashes: exact ids, ref counts, eviction order."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loom.block_hash import (
    ROOT_BLOCK_HASH,
    extend_block_hashes,
    hash_block_tokens,
    hash_token_blocks,
)
from loom.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from loom.request import FinishReason, Request, RequestStatus
from loom.sampling_params import SamplingParams


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def cache_as_sequence(
    pool: BlockPool, blocks: list[KVCacheBlock], tokens: list[int], bs: int
) -> None:
    hashes = hash_token_blocks(tokens, bs)
    pool.cache_full_blocks(blocks, hashes, tokens, 0, len(hashes), bs)


# ---- free queue ----------------------------------------------------------------------------


def test_free_queue_order_and_o1_ops() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 5
    q.remove(blocks[2])  # middle
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    q.append(blocks[2])
    q.appendleft(q.popleft_n(2)[1])  # pop 0, 1; put 1 back at the head
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2]
    assert q.popleft() is blocks[1]
    assert len(q) == 3


def test_free_queue_rejects_double_insert_and_bad_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    q.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    with pytest.raises(ValueError, match="asked for 1"):
        q.popleft_n(1)


# ---- block pool ----------------------------------------------------------------------------


def test_block_zero_is_reserved() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.get_num_free_blocks() == 4
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(4)
    assert ids(blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, enable_caching=False)


def test_touch_and_free_ref_counts() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    assert (a.ref_cnt, b.ref_cnt) == (2, 1)
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 0)
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])


def test_eviction_order_lru_and_tail_of_sequence_first() -> None:
    bs = 2
    pool = BlockPool(7, enable_caching=True)  # usable 1..6
    seq_a = pool.get_new_blocks(3)  # [1, 2, 3]
    seq_b = pool.get_new_blocks(2)  # [4, 5]
    tokens_a, tokens_b = [1, 2, 3, 4, 5, 6], [9, 8, 7, 6]
    cache_as_sequence(pool, seq_a, tokens_a, bs)
    cache_as_sequence(pool, seq_b, tokens_b, bs)
    assert len(pool.cached_block_hash_to_block) == 5

    pool.free_blocks(reversed(seq_a))  # freed first: least recently used
    pool.free_blocks(reversed(seq_b))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [6, 3, 2, 1, 5, 4]

    # Cached blocks are reachable until popped; popping evicts exactly the popped ones.
    hashes_a = hash_token_blocks(tokens_a, bs)
    assert ids(pool.get_new_blocks(2)) == [6, 3]
    assert pool.get_cached_block(hashes_a[2]) is None  # tail of A evicted first
    assert pool.get_cached_block(hashes_a[1]) is seq_a[1]
    assert seq_a[2].block_hash is None and seq_a[2].token_ids is None
    assert ids(pool.get_new_blocks(4)) == [2, 1, 5, 4]
    assert pool.cached_block_hash_to_block == {}


def test_uncached_freed_block_is_reused_before_cached_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    cached, plain = pool.get_new_blocks(2)
    cache_as_sequence(pool, [cached], [5, 5], 2)
    pool.free_blocks([cached, plain])
    # Block 3 never used, block 2 holds nothing: both go before cached block 1.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 1]


def test_touch_revives_cached_free_block_from_middle() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    cache_as_sequence(pool, blocks, [1, 2, 3, 4, 5, 6], 2)
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 2, 1]
    hit = pool.get_cached_block(hash_token_blocks([1, 2, 3, 4], 2)[1])
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 1]
    assert pool.get_num_free_blocks() == 3


def test_duplicate_full_block_stays_uncached() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    cache_as_sequence(pool, first, [7, 7], 2)
    cache_as_sequence(pool, second, [7, 7], 2)
    assert first[0].block_hash is not None
    assert second[0].block_hash is None
    assert list(pool.cached_block_hash_to_block.values()) == first


def test_caching_disabled_never_caches() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    cache_as_sequence(pool, blocks, [1, 2], 2)
    assert pool.cached_block_hash_to_block == {}
    assert pool.get_cached_block(hash_token_blocks([1, 2], 2)[0]) is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    cache_as_sequence(pool, blocks, [1, 2, 3, 4], 2)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)


# ---- hashes --------------------------------------------------------------------------------

_HASH_SNIPPET = (
    "from loom.block_hash import hash_block_tokens as h;"
    "p = h(None, [1, 2, 3, 4], ('lora', 7));"
    "print(h(p, [5, 6, 7, 8], ('lora', 7)).hex())"
)


def test_hash_is_stable_across_processes() -> None:
    parent = hash_block_tokens(None, [1, 2, 3, 4], ("lora", 7))
    here = hash_block_tokens(parent, [5, 6, 7, 8], ("lora", 7)).hex()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _HASH_SNIPPET], capture_output=True, text=True, env=env,
            check=True,
        )
        assert out.stdout.strip() == here
    assert len(bytes.fromhex(here)) == 16


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2])
    assert base == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    assert base != hash_block_tokens(None, [2, 1])
    assert base != hash_block_tokens(None, [1, 2], ("lora", 1))
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))
    assert hash_block_tokens(base, [3, 4]) != hash_block_tokens(None, [3, 4])
    with pytest.raises(TypeError, match="extra keys"):
        hash_block_tokens(None, [1], (object(),))


def test_incremental_hashes_match_full_recompute() -> None:
    tokens = list(range(11))
    hashes: list = []
    assert extend_block_hashes(hashes, tokens[:3], 4) == 0
    assert extend_block_hashes(hashes, tokens[:9], 4) == 2
    assert extend_block_hashes(hashes, tokens, 4) == 0
    assert hashes == hash_token_blocks(tokens, 4)
    assert len(hashes) == 2


def test_request_keeps_block_hashes_for_full_blocks_only() -> None:
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(), eos_token_ids=(0,), block_size=4)
    assert req.block_hashes == hash_token_blocks([1, 2, 3, 4], 4)
    req.append_output_token_ids([6, 7])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids(8)
    assert req.block_hashes == hash_token_blocks(list(range(1, 9)), 4)
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert req.output_token_ids == [6, 7, 8]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_cached_tokens) == (8, 5, -1)
    with pytest.raises(ValueError, match="block_size already 4"):
        req.enable_block_hashing(8)


def test_request_status_and_finish_reason() -> None:
    req = Request("r", [1], SamplingParams())
    assert not req.is_finished() and req.get_finished_reason() is None
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    for status, reason in [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
    ]:
        req.status = status
        assert req.is_finished()
        assert req.get_finished_reason() == reason
        assert isinstance(req.get_finished_reason(), FinishReason)
