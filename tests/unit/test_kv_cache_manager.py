"""KVCacheManager: exact block ids, prefix hits (never the last token), no-side-effect failure,
eviction order and integrity checks."""

from __future__ import annotations

import pytest

from loom.core.kv_cache_manager import KVCacheIntegrityError, KVCacheManager
from loom.request import Request
from loom.sampling_params import SamplingParams

BS = 4


def make_manager(
    num_blocks: int = 11, caching: bool = True, max_model_len: int = 64
) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=caching, max_model_len=max_model_len)


def make_request(rid: str, tokens: list[int], **params: object) -> Request:
    return Request(rid, tokens, SamplingParams(**params), block_size=BS)  # type: ignore[arg-type]


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """Schedule the whole prompt as a scheduler would and mark it computed."""
    blocks, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, blocks, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    return kv.get_block_ids(req.request_id)


def test_first_allocation_starts_at_block_one_and_caches_full_blocks() -> None:
    kv = make_manager()
    req = make_request("a", list(range(10)))
    new = kv.allocate_slots(req, 10)
    assert new is not None and [b.block_id for b in new] == [1, 2, 3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    # Two full blocks are cached as soon as they are scheduled; the partial one is not.
    assert [b.block_hash is not None for b in new] == [True, True, False]
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    assert kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)
    kv.check_integrity()


def test_prefix_hit_shares_blocks_by_ref_count() -> None:
    kv = make_manager()
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [1, 2, 3]
    b = make_request("b", list(range(10)))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [1, 2] and num_hit == 8
    new = kv.allocate_slots(b, 2, blocks, num_hit)
    assert new is not None and [blk.block_id for blk in new] == [4]
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (20, 8)
    assert kv.prefix_cache_stats.requests == 2
    assert kv.prefix_cache_stats.hit_rate == pytest.approx(0.4)
    kv.check_integrity()


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit"), [(8, 4), (9, 8), (12, 8), (13, 12), (4, 0)]
)
def test_prefix_hit_never_covers_last_token(prompt_len: int, expected_hit: int) -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(prompt_len))))
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(prompt_len))))
    assert num_hit == expected_hit
    assert num_hit <= prompt_len - 1
    assert len(blocks) == expected_hit // BS


def test_prefix_hit_stops_at_first_different_block() -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(13))))
    tokens = list(range(13))
    tokens[5] = 99  # second block differs, so the third cannot match either (chained hash)
    blocks, num_hit = kv.get_computed_blocks(make_request("b", tokens))
    assert [b.block_id for b in blocks] == [1] and num_hit == 4


def test_hit_verifies_stored_token_ids() -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(9))))
    # Simulate a hash collision: the cached block's stored tokens no longer match.
    kv.block_pool.blocks[1].token_ids = (42, 42, 42, 42)
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(9))))
    assert blocks == [] and num_hit == 0


def test_prompt_logprobs_and_disabled_caching_skip_the_cache() -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1)) == ([], 0)
    off = make_manager(caching=False)
    admit(off, make_request("a", list(range(9))))
    assert off.block_pool.cached_block_hash_to_block == {}
    assert off.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_failed_allocation_has_no_side_effects() -> None:
    kv = make_manager(num_blocks=5)  # 4 usable
    a = make_request("a", list(range(9)))
    admit(kv, a)  # blocks 1, 2, 3
    kv.free(a)  # 1, 2 cached and free; 3 uncached and free
    b = make_request("b", list(range(9)) + [50] * 8)  # 17 tokens: 5 blocks, 2 of them hits
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    queue_before = [blk.block_id for blk in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert kv.allocate_slots(b, 9, blocks, num_hit) is None
    assert kv.get_block_ids("b") == [] and "b" not in kv.req_to_blocks
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    after = [blk.block_id for blk in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert after == queue_before
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    kv.check_integrity()
    # Free blocks counted against revived hit blocks: 2 hits + 2 new = the 4 free blocks.
    c = make_request("c", list(range(9)) + [50] * 4)  # 13 tokens: 4 blocks
    blocks, num_hit = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, 5, blocks, num_hit)
    assert new is not None and kv.get_block_ids("c") == [1, 2, 3, 4]
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_decode_allocates_only_at_block_boundary_and_caches_output_blocks() -> None:
    kv = make_manager()
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, req)
    assert kv.get_block_ids("a") == [1, 2]
    req.append_output_token_ids(7)
    assert kv.allocate_slots(req, 1) == []  # token 7 fits in block 2
    req.num_computed_tokens += 1
    req.append_output_token_ids(8)
    assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    # Block 2 now full (tokens 5..8, two of them outputs) and cached.
    assert kv.block_pool.blocks[2].token_ids == (5, 6, 7, 8)
    assert kv.block_pool.get_cached_block(req.block_hashes[1]) is kv.block_pool.blocks[2]
    req.append_output_token_ids(9)
    new = kv.allocate_slots(req, 1)
    assert new is not None and [b.block_id for b in new] == [3]
    kv.check_integrity()


def test_free_releases_in_reverse_order_so_tail_is_evicted_first() -> None:
    kv = make_manager(num_blocks=6)  # 5 usable
    a = make_request("a", list(range(13)))  # blocks 1..4, 3 of them cached
    admit(kv, a)
    kv.free(a)
    kv.check_integrity()
    # Uncached partial block 4 first, then unused 5, then cached 3, 2, 1 (tail first).
    order = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert order == [4, 5, 3, 2, 1]
    b = make_request("b", [77] * 12)
    new = kv.allocate_slots(b, 12)
    assert new is not None and [blk.block_id for blk in new] == [4, 5, 3]
    # Block 3 (a's third block) was evicted; a's first two blocks still hit.
    blocks, num_hit = kv.get_computed_blocks(make_request("a2", list(range(13))))
    assert [blk.block_id for blk in blocks] == [1, 2] and num_hit == 8


def test_free_shared_blocks_keeps_them_for_other_holder() -> None:
    kv = make_manager()
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(kv, a)
    assert admit(kv, b) == [1, 2, 4]
    kv.free(a)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.check_integrity()
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert kv.num_free_blocks == kv.num_usable_blocks == 10
    kv.check_integrity()


def test_allocation_beyond_max_model_len_is_an_error() -> None:
    kv = make_manager(max_model_len=8)
    assert kv.max_num_blocks_per_req == 2
    with pytest.raises(ValueError, match="max_model_len"):
        kv.allocate_slots(make_request("a", list(range(9))), 9)
    with pytest.raises(ValueError, match="positive"):
        kv.allocate_slots(make_request("b", [1]), 0)


def test_check_integrity_detects_breaches() -> None:
    kv = make_manager()
    admit(kv, make_request("a", list(range(9))))
    kv.check_integrity()
    kv.block_pool.blocks[1].ref_cnt += 1  # a leaked reference
    with pytest.raises(KVCacheIntegrityError, match="ref_cnt 2 but 1 requests"):
        kv.check_integrity()
    kv.block_pool.blocks[1].ref_cnt -= 1
    kv.block_pool.free_block_queue.popleft()  # a block lost from the queue
    with pytest.raises(KVCacheIntegrityError, match="free .* \\+ in use"):
        kv.check_integrity()


def test_check_integrity_detects_referenced_block_in_free_queue() -> None:
    kv = make_manager()
    kv.block_pool.blocks[5].ref_cnt = 1
    with pytest.raises(KVCacheIntegrityError, match="in the free queue with ref_cnt 1"):
        kv.check_integrity()


def test_check_integrity_detects_held_blocks_after_drain() -> None:
    kv = make_manager()
    a = make_request("a", list(range(5)))
    admit(kv, a)
    del kv.req_to_blocks["a"]  # a request vanished without freeing
    with pytest.raises(KVCacheIntegrityError, match="0 requests hold it"):
        kv.check_integrity()


def test_manager_hashes_requests_made_without_block_size() -> None:
    kv = make_manager()
    a = Request("a", list(range(9)), SamplingParams())
    assert a.block_hashes == []
    admit(kv, a)
    assert len(a.block_hashes) == 2 and a.block_size == BS
    blocks, num_hit = kv.get_computed_blocks(Request("b", list(range(9)), SamplingParams()))
    assert [blk.block_id for blk in blocks] == [1, 2] and num_hit == 8


@pytest.mark.parametrize(("prompt_len", "min_new", "expected_hit"),
                         [(14, 0, 12), (14, 3, 8), (14, 6, 8), (14, 7, 4), (14, 14, 0),
                          (14, 15, 12), (5, 9, 4)])
def test_prefix_hit_leaves_min_new_tokens(prompt_len: int, min_new: int,
                                          expected_hit: int) -> None:
    """min_new_tokens (the engine's: one past the rows the CPU's small-step kernels take): a
    hit leaves at least that many tokens to compute, in whole blocks, where the request has
    that many (a shorter one ran on those kernels the first time too); the stats count what
    is used."""
    kv = make_manager()
    admit(kv, make_request("a", list(range(prompt_len))))
    kv.min_new_tokens = min_new
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(prompt_len))))
    assert num_hit == expected_hit and len(blocks) == expected_hit // BS
    assert kv.prefix_cache_stats.hits == expected_hit


def test_min_new_tokens_leaves_prompt_logprob_hits_alone() -> None:
    """Scores (prompt logprobs from a start) keep their hits up to the start: from the cache
    they are close, not exact, whatever the kernels."""
    kv = make_manager()
    admit(kv, make_request("a", list(range(14))))
    kv.min_new_tokens = 7
    req = make_request("b", list(range(14)), prompt_logprobs=0, prompt_logprobs_start=13)
    assert kv.get_computed_blocks(req)[1] == 12
