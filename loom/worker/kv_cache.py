"""Size and allocate the paged KV cache from the memory actually available."""

from __future__ import annotations

import ctypes
import logging
import mmap

import psutil
import torch

from loom.heap import madvise, zeros
from loom.config import KV_CACHE_DTYPES, CacheConfig, ConfigError, ModelConfig
from loom.quant.int8 import GROUP

logger = logging.getLogger(__name__)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for `--kv-cache-dtype name`: auto is the model's."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"unsupported kv_cache_dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPES)}"
        )
    if name == "fp8":
        return torch.float8_e4m3fn
    return model_dtype if name == "auto" else getattr(torch, name)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the cache's last dimension per (slot, kv head): head_dim, or for int8 the
    head_dim values and then head_dim / 32 fp32 scales and minimums, 4 bytes each
    (torch_ref.quantize_kv)."""
    if dtype != torch.int8:
        return head_dim
    if head_dim % GROUP != 0:
        raise ConfigError(f"kv_cache_dtype int8 needs a head_dim divisible by {GROUP}, "
                          f"not {head_dim}")
    return head_dim + head_dim // GROUP * 8


def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 * layers * block_size * kv_heads * row * itemsize."""
    per_token = 2 * model_config.num_kv_layers * model_config.num_key_value_heads
    per_token *= row_width(model_config.head_dim, dtype) * dtype.itemsize
    return per_token * block_size


def available_memory(device: torch.device) -> int:
    """Free bytes: device memory on CUDA, the host's available memory otherwise (psutil:
    /proc/meminfo's MemAvailable on Linux, free, inactive and purgeable pages on macOS)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def determine_num_blocks(
    cache_config: CacheConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_needed_tokens: int,
) -> int:
    """Blocks from an explicit count, `kv_cache_memory` bytes, or a fraction of free memory.

    The memory rules never allocate more than `max_needed_tokens` worth (plus the null block):
    a bigger cache could never be used.
    """
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    per_block = bytes_per_block(model_config, cache_config.block_size, dtype)
    budget = cache_config.kv_cache_memory
    if budget is None:
        budget = int(available_memory(device) * cache_config.memory_fraction)
    num_blocks = budget // per_block
    cap = -(-max_needed_tokens // cache_config.block_size) + 1
    num_blocks = min(num_blocks, cap)
    if num_blocks < 2:
        raise MemoryError(
            f"the KV cache budget ({budget} bytes) holds less than one block of {per_block} bytes; "
            "raise kv_cache_memory"
        )
    return int(num_blocks)


def allocate_kv_caches(
    model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, row_width] tensor per layer, zeroed.

    Attention reads whole blocks, including slots no request has written yet (masked out, so
    they must hold finite numbers). On the host the zeroes come from calloc (loom.heap.zeros):
    a layer's cache's memory is committed only when first written.
    """
    shape = (2, num_blocks, block_size, model_config.num_key_value_heads,
             row_width(model_config.head_dim, dtype))
    return [zeros(shape, dtype, device) for _ in range(model_config.num_kv_layers)]


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, contents untouched


class KVPrefaulter:
    """Faults in the host pages of chosen KV-cache blocks before a step writes them.

    A cache past glibc's mmap threshold comes from calloc untouched (allocate_kv_caches), so the
    first write to each page costs a page fault and the kernel zeroing the page, inside the
    step's rope + KV write (docs/cpu_kernels.md). The engine calls `populate` with
    the blocks it hands out next while it has nothing else to do. madvise(MADV_POPULATE_WRITE)
    commits the pages without writing them (block contents, and the pages a block shares with
    its neighbours, stay as they are); where the kernel lacks it (Linux before 5.14, other
    systems), nothing happens.
    """

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self._madvise = madvise()  # None off Linux
        self.ok = (self._madvise is not None and bool(caches)
                   and all(c.device.type == "cpu" for c in caches))
        self.halves: list[tuple[int, int]] = []  # (address of block 0, bytes a block): K, V
        if self.ok:
            for c in caches:
                block_bytes = c[0, 0].numel() * c.element_size()
                self.halves += [(c[0].data_ptr(), block_bytes), (c[1].data_ptr(), block_bytes)]
            self._page = mmap.PAGESIZE
        self.resident: set[int] = set()

    def populate(self, block_ids: list[int], max_blocks: int | None = None) -> int:
        """Commit the pages of the first `max_blocks` (default: all) of `block_ids` not committed
        here before; returns how many blocks that was (0: none new, or no way to do it here)."""
        new = sorted([b for b in block_ids if b not in self.resident][:max_blocks])
        if not self.ok or not new:
            return 0
        runs: list[list[int]] = []  # consecutive ids: one call a run
        for b in new:
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + 1
            else:
                runs.append([b, b + 1])
        page = self._page
        for base, size in self.halves:
            for start, end in runs:
                lo = (base + start * size) // page * page
                hi = base + end * size
                if self._madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                    logger.debug("no MADV_POPULATE_WRITE here (errno %d)", ctypes.get_errno())
                    self.ok = False
                    return 0
        self.resident.update(new)
        return len(new)
