"""KV-cache blocks, their O(1) LRU free queue, and the pool that hands them out and caches them.

Block states (a block is in exactly one):

    | state          | ref_cnt | in free queue | block_hash                      |
    |----------------|---------|---------------|---------------------------------|
    | null (id 0)    | 0       | no            | None; never handed out          |
    | in use         | > 0     | no            | set if full and cached, or None |
    | free, cached   | 0       | yes           | set: a prefix hit may revive it |
    | free, empty    | 0       | yes           | None                            |

A cached block is in `BlockPool.cached_block_hash_to_block` under its hash; at most one block per
hash is cached (a duplicate full block simply stays uncached).

Blocks never handed out yet ("fresh") are not objects: the free queue holds them as one run, a
placeholder node, and a block's object is made when it is first handed out, peeked at or looked
up (the default CPU pool has ~50k blocks: building them all took 0.2-0.8 s of every start). On
the CPU a fresh block is also memory the process has never touched; `resident_blocks` bounds
how many blocks the pool touches for the prefix cache's sake (see BlockPool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from loom.block_hash import BlockHash


@dataclass(slots=True, eq=False, repr=False)
class KVCacheBlock:
    """One block of `block_size` KV slots. Compared by identity."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is full and registered in the prefix cache.
    block_hash: BlockHash | None = None
    # The block's token ids while cached, checked again on every prefix hit.
    token_ids: tuple[int, ...] | None = None
    # Free-queue links; both None exactly when the block is not in the queue.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, appendleft and remove.

    Eviction order: allocation pops from the head, so the head is the next block to be reused
    (and, if it is cached, evicted from the prefix cache). `BlockPool.free_blocks` appends cached
    blocks at the tail, and callers free a request's blocks in reverse order, so of one freed
    sequence the last block sits nearest the head and is evicted first, while the shared prefix
    (its first blocks) survives longest. Across requests the order is least recently freed first
    (LRU). Blocks with no cached content are put at the head: reusing them costs nothing.
    A cached block revived by a prefix hit is removed from the middle in O(1).

    Fresh blocks (`fresh` ids, made by `make` when first reached) sit after `blocks` as one
    run: blocks put at the head come before it, blocks put at the tail after it, so the order is
    the same as if every fresh block had been queued. `park_fresh` moves the run to the end for
    good (blocks appended later go before it): every freed block is then reused, cached ones
    evicted, before a fresh one is taken.
    """

    def __init__(
        self, blocks: Sequence[KVCacheBlock], fresh: range = range(0),
        make: Callable[[int], KVCacheBlock] = KVCacheBlock,
    ) -> None:
        # Sentinels: every queued block has a non-None prev and next.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        # The fresh run: a placeholder node, linked while fresh ids remain.
        self._fresh = KVCacheBlock(-2)
        self._fresh_next, self._fresh_stop = fresh.start, fresh.stop
        self._make = make
        self._parked = False
        for block in blocks:
            self.append(block)
        if len(fresh):
            self._insert_after(self._tail.prev_free_block, self._fresh)  # type: ignore[arg-type]
            self.num_free_blocks += len(fresh)

    @property
    def num_fresh_blocks(self) -> int:
        return self._fresh_stop - self._fresh_next

    def _take_fresh(self) -> KVCacheBlock:
        block = self._make(self._fresh_next)
        self._fresh_next += 1
        self.num_free_blocks -= 1
        if not self.num_fresh_blocks:  # the run is used up: its node leaves the queue
            self._unlink(self._fresh)
        return block

    def park_fresh(self) -> None:
        """From now on, hand out a fresh block only when no other block is free."""
        if self._parked:
            return
        self._parked = True
        if self.num_fresh_blocks:
            self._unlink(self._fresh)
            self._insert_after(self._tail.prev_free_block, self._fresh)  # type: ignore[arg-type]

    def _unlink(self, node: KVCacheBlock) -> None:
        prev, nxt = node.prev_free_block, node.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        node.prev_free_block = node.next_free_block = None

    def _walk(self, make_fresh: bool = True) -> Iterator[KVCacheBlock]:
        """Queued blocks, head first; the fresh run's blocks made as they are reached (or
        skipped, with make_fresh=False)."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            if block is not self._fresh:
                yield block
            elif make_fresh:
                for i in range(self._fresh_next, self._fresh_stop):
                    yield self._make(i)
            block = block.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the next to reuse)."""
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("no free blocks left")
        if block is self._fresh:
            return self._take_fresh()
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (before a parked fresh run): it will be reused last."""
        last = self._tail.prev_free_block
        if last is self._fresh and self._parked:
            last = self._fresh.prev_free_block
        self._insert_after(last, block)  # type: ignore[arg-type]
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head: it will be reused first."""
        self._insert_after(self._head, block)
        self.num_free_blocks += 1

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        """Link `block` after `prev` (counted by the caller, like `_unlink`)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        nxt = prev.next_free_block
        assert nxt is not None
        block.prev_free_block, block.next_free_block = prev, nxt
        prev.next_free_block = block
        nxt.prev_free_block = block

    def peek(self, n: int) -> list[KVCacheBlock]:
        """The first `n` queued blocks (fewer if fewer are queued): the next handed out."""
        out: list[KVCacheBlock] = []
        if n > 0:
            for block in self._walk():
                out.append(block)
                if len(out) == n:
                    break
        return out

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All queued blocks, head (next reused) first. O(n), and makes every fresh block: for
        tests."""
        return list(self._walk())

    def queued_made_blocks(self) -> tuple[list[KVCacheBlock], range]:
        """The queued blocks made so far, head first, and the ids of the fresh run not yet made
        (none of them is made by this): for integrity checks, which must not build a large
        pool's every block (tens of thousands of objects) after a failed step."""
        return list(self._walk(make_fresh=False)), range(self._fresh_next, self._fresh_stop)


class _Blocks(Sequence[KVCacheBlock]):
    """`BlockPool.blocks`: every block by id, each made on first access."""

    def __init__(self, num_blocks: int) -> None:
        self._made: list[KVCacheBlock | None] = [None] * num_blocks

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        block = self._made[i]
        if block is None:
            block = self._made[i] = KVCacheBlock(range(len(self))[i])
        return block

    def made(self) -> Iterator[KVCacheBlock]:
        """The blocks made so far (the others are fresh: free, uncached, ref_cnt 0)."""
        return (b for b in self._made if b is not None)


class BlockPool:
    """Owns every KVCacheBlock: hands out free ones, counts references, keeps the prefix cache.

    Block 0 is the null/padding block: it is never in the free queue and never handed out, so
    `num_blocks - 1` blocks are usable.

    `resident_blocks`: once that many blocks have been handed out at least once, a freed block
    (cached ones evicted, least recently freed first) is reused before a fresh one is taken, so
    the blocks ever written (on the CPU, the KV cache's resident memory) stay within
    max(resident_blocks, the most blocks in use at once). None: fresh blocks first until none is
    left (every free block stays cached as long as possible).
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, resident_blocks: int | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        if resident_blocks is not None and resident_blocks < 1:
            raise ValueError(f"resident_blocks must be positive, got {resident_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.resident_blocks = resident_blocks
        self.blocks = _Blocks(num_blocks)
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(
            (), fresh=range(1, num_blocks), make=self.blocks.__getitem__)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_touched_blocks(self) -> int:
        """Blocks handed out at least once."""
        return self.num_usable_blocks - self.free_block_queue.num_fresh_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, evicting their cached
        content, each with ref_cnt 1. Raises ValueError when too few are free."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"{block} was in the free queue"
            self._evict(block)
            block.ref_cnt = 1
        if self.resident_blocks is not None and self.num_touched_blocks >= self.resident_blocks:
            self.free_block_queue.park_fresh()
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of one sequence in the prefix cache.

        `block_hashes[i]` is the hash of block i of `token_ids`. Blocks that are already cached
        (prefix hits) are skipped; a block whose hash another block already caches stays
        uncached (its twin serves future hits).
        """
        if not self.enable_caching:
            return
        assert num_full_blocks <= len(block_hashes), "hash missing for a full block"
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(token_ids[i * block_size : (i + 1) * block_size])
            self.cached_block_hash_to_block[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hits), reviving free cached ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue in the
        given order (pass a request's blocks reversed: its tail is then evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_block_queue.append(block)
                else:
                    self.free_block_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use; returns whether it did."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            block.token_ids = None
        self.cached_block_hash_to_block.clear()
        return True
