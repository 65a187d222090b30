"""Per-request KV block tables on top of the BlockPool, with prefix-cache lookup."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loom.core.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from loom.request import Request


class KVCacheIntegrityError(RuntimeError):
    """The block accounting is inconsistent; the message names the breach."""


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, counted in tokens."""

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up (each request's num_tokens at lookup)
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_resident_blocks(device_type: str, max_model_len: int, block_size: int) -> int | None:
    """The pool's resident bound by default (BlockPool): on the CPU, one full context's blocks,
    so the prefix cache keeps at most that much idle history in memory (the KV cache is a lazily
    touched allocation there: without a bound a server's RSS grew with every token it saw,
    up to the whole pool); elsewhere none (the device's pool is allocated up front)."""
    return _cdiv(max_model_len, block_size) if device_type == "cpu" else None


class KVCacheManager:
    """Maps requests to their KV blocks.

    Invariants:
    - `req_to_blocks[rid]` covers at least the request's scheduled tokens; block i holds
      tokens [i * block_size, (i + 1) * block_size).
    - Each block's ref_cnt equals the number of request block lists holding it.
    - `num_cached_block[rid]` blocks of the request have been offered to the prefix cache.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int,
        resident_blocks: int | None = None,
    ) -> None:
        """`resident_blocks`: see BlockPool (None: no bound)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        # Width of a block table row: the most blocks one request can hold.
        self.max_num_blocks_per_req = _cdiv(max_model_len, block_size)
        self.block_pool = BlockPool(num_blocks, enable_caching, resident_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # A hit leaves at least this many of a request's tokens to compute (where it has that
        # many, and asks for no prompt logprobs, whose scores from the cache are close, not
        # exact, anyway; 0: no rule), set by the engine where a step of fewer rows runs other
        # kernels than a longer prompt's (the CPU's decode kernels): the tokens after a hit are
        # then computed as the whole prompt was the first time, so a repeated greedy request
        # gives the same tokens with and without the cache.
        self.min_new_tokens = 0
        # A hybrid model's: whether a block (by hash) ends where its states were kept; a hit
        # ends on such a block (None: any block)
        self.state_hit: Callable[[object], bool] | None = None

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks that prefixes the request's tokens.

        Never covers the last token (its logits are needed): at most num_tokens - 1 tokens,
        rounded down to whole blocks. Takes no references; pass the result to allocate_slots.
        Requests asking for prompt logprobs skip the cache (every prompt position must run),
        unless they set `prompt_logprobs_start`: then hits stop before position start - 1, whose
        logits give the first logprob asked for. Mean-pooling embedding requests skip it too.
        """
        params = request.sampling_params
        if not self.enable_caching or (
            params.prompt_logprobs is not None and params.prompt_logprobs_start == 0
        ) or params.pooling == "mean":
            return [], 0
        request.enable_block_hashing(self.block_size)  # no-op once the scheduler did it
        max_hit_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        if params.prompt_logprobs is not None:
            last_hit = (params.prompt_logprobs_start - 1) // self.block_size
            max_hit_blocks = min(max_hit_blocks, last_hit)
        elif request.num_tokens >= self.min_new_tokens > 0:  # (scores are close, not exact)
            max_hit_blocks = min(max_hit_blocks,
                                 (request.num_tokens - self.min_new_tokens) // self.block_size)
        tokens = request.all_token_ids
        bs = self.block_size
        blocks: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            block = self.block_pool.get_cached_block(request.block_hashes[i])
            # Token check on hit: a hash collision must never serve someone else's KV.
            if block is None or block.token_ids != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            blocks.append(block)
        if self.state_hit is not None:  # a hybrid: up to the last block with its states
            while blocks and not self.state_hit(request.block_hashes[len(blocks) - 1]):
                blocks.pop()
        num_computed_tokens = len(blocks) * bs
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_computed_tokens
        return blocks, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix hit from
        get_computed_blocks (first schedule only). Returns the newly allocated blocks (maybe
        empty), or None with no side effect when too few blocks are free. Full blocks among the
        scheduled tokens are cached at once: the runner writes every scheduled token's KV
        before attention reads it, so a later request in the same step may hit them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        computed = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if computed and req_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_total_tokens = num_computed_tokens + num_new_tokens
        if num_total_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: {num_total_tokens} tokens exceed "
                f"max_model_len {self.max_model_len}"
            )
        num_required = _cdiv(num_total_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(computed))
        # Hit blocks with no user sit in the free queue; touching them uses up free blocks too.
        num_revived = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            return None

        if computed:
            self.block_pool.touch(computed)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        req_blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            request.enable_block_hashing(self.block_size)  # no-op once the scheduler did it
            self._cache_full(request, num_total_tokens)
        return new_blocks

    def _cache_full(self, request: Request, num_tokens: int) -> None:
        """Offer the prefix cache the request's full blocks among its first `num_tokens` whose
        hashes are known (its tokens'), past those offered already."""
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[request.request_id], request.block_hashes,
                request.all_token_ids, num_cached, num_full, self.block_size,
            )
            self.num_cached_block[request.request_id] = num_full

    def cache_computed(self, request: Request) -> None:
        """Offer the prefix cache the request's full blocks of computed tokens not offered yet:
        a verify step's, whose draft tokens had no hashes when their blocks were allocated."""
        if self.enable_caching and request.request_id in self.req_to_blocks:
            self._cache_full(request, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release all of a request's blocks, last block first (so it is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks of the request's first `num_tokens` tokens (rejected speculative
        tokens roll back); the ones past them are freed, last first. They hold no full block of
        the request's tokens, so none was offered to the prefix cache."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = _cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        dropped = blocks[keep:]
        del blocks[keep:]
        cached = self.num_cached_block.get(request.request_id, 0)
        if cached > keep:
            self.num_cached_block[request.request_id] = keep
        self.block_pool.free_blocks(reversed(dropped))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self.req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raise KVCacheIntegrityError unless the block accounting is consistent: free + in use
        == total - 1 (block 0 reserved), queued blocks have ref_cnt 0, each ref_cnt equals the
        number of requests holding the block (so all are zero when none is held), and the
        prefix-cache map agrees with the blocks."""
        pool = self.block_pool

        def fail(msg: str) -> None:
            raise KVCacheIntegrityError(f"KV cache integrity: {msg}")

        # the queue's fresh run (never handed out) is counted, not made: a block of it that
        # was made since would be in use or queued twice, which the counts below catch
        queued, fresh = pool.free_block_queue.queued_made_blocks()
        num_free = len(queued) + len(fresh)
        if num_free != pool.get_num_free_blocks():
            fail(f"free queue holds {num_free} blocks but counts {pool.get_num_free_blocks()}")
        for block in queued:
            if block.ref_cnt != 0:
                fail(f"{block} is in the free queue with ref_cnt {block.ref_cnt}")
            if block is pool.null_block:
                fail("null block 0 is in the free queue")
            if block.block_id in fresh:
                fail(f"{block} is in the free queue and in its fresh run")
        in_use = [block for block in pool.blocks.made() if block.ref_cnt > 0]
        for block in in_use:
            if block.block_id in fresh:  # (queued, as a fresh block not yet taken)
                fail(f"{block} is in the free queue with ref_cnt {block.ref_cnt}")
        if num_free + len(in_use) != pool.num_blocks - 1:
            fail(
                f"free ({num_free}) + in use ({len(in_use)}) != total - 1 ({pool.num_blocks - 1})"
            )
        holders = Counter(id(block) for blocks in self.req_to_blocks.values() for block in blocks)
        for block in pool.blocks.made():  # a block not made yet is fresh: ref_cnt 0
            if block.ref_cnt < 0 or block.ref_cnt != holders.get(id(block), 0):
                fail(
                    f"{block} has ref_cnt {block.ref_cnt} but {holders.get(id(block), 0)} "
                    "requests hold it"
                )
        for block_hash, block in pool.cached_block_hash_to_block.items():
            if block.block_hash != block_hash:
                fail(f"{block} is cached under a hash it does not carry")
