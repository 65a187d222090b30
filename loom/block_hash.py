"""Stable chained hashes of full KV-cache blocks, the keys of the prefix cache.

The hash of block i covers the hash of block i-1, block i's token ids and optional extra keys
(for example a LoRA id or a cache salt). Equal hashes therefore mean equal *prefixes*, not only
equal blocks. The digest is xxh3-128 over a fixed byte encoding, so it is the same in every
process and every run; Python's `hash()` is salted per process and must not be used here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NewType

import xxhash

# 16-byte xxh3-128 digest.
BlockHash = NewType("BlockHash", bytes)

# Stand-in parent of the first block of every sequence, so every encoding has the same layout.
ROOT_BLOCK_HASH = BlockHash(xxhash.xxh3_128_digest(b"loom.block_hash.root"))

_EXTRA_KEY_TYPES = (int, str, bytes, float, type(None))


def _check_extra_keys(keys: tuple[object, ...]) -> None:
    """Only types whose repr() is stable across processes are allowed in extra keys."""
    for key in keys:
        if isinstance(key, tuple):
            _check_extra_keys(key)
        elif not isinstance(key, _EXTRA_KEY_TYPES):
            raise TypeError(
                f"block hash extra keys must be int, str, bytes, float, None or tuples of them; "
                f"got {type(key).__name__}: {key!r}"
            )


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash one block: (parent hash or ROOT_BLOCK_HASH, token ids, extra keys)."""
    hasher = xxhash.xxh3_128()
    hasher.update(ROOT_BLOCK_HASH if parent_hash is None else parent_hash)
    # Length prefix, then little-endian int64 ids: no two token lists share an encoding.
    hasher.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys:
        _check_extra_keys(extra_keys)
        hasher.update(repr(extra_keys).encode())
    return BlockHash(hasher.digest())


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[object, ...] | None = None,
) -> int:
    """Append the hashes of blocks of `token_ids` that became full since the last call.

    `block_hashes` must hold the hashes of the first len(block_hashes) blocks of `token_ids`
    (a request's `block_hashes`). Partial trailing blocks are never hashed. Returns the number
    of hashes appended.
    """
    start = len(block_hashes)
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(start, num_full_blocks):
        parent = hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys
        )
        block_hashes.append(parent)
    return max(0, num_full_blocks - start)


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple[object, ...] | None = None
) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids`."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, extra_keys)
    return hashes
