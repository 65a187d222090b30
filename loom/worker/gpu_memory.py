"""Size the KV cache from the GPU's memory (`--gpu-memory-utilization`), as vLLM does.

After the weights load, one dummy step of the largest size the scheduler can send
(max_num_batched_tokens tokens over up to max_num_seqs requests, logits and a softmax for
every request) runs with torch's peak-memory counter reset. The KV cache then gets

    utilization * total memory - peak bytes torch held - bytes outside torch (the CUDA
    context, other processes)

Only the CUDA engine calls `profile_kv_cache_memory`; `dummy_step` and `kv_budget` are plain
and run (and are tested) on the CPU too.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loom.attention.forward_context import set_forward_context
from loom.attention.metadata import build_attention_metadata
from loom.config import ModelConfig
from loom.worker.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


def kv_budget(total: int, utilization: float, peak_torch: int, non_torch: int) -> int:
    """Bytes left for the KV cache. Example: 141 GB * 0.9 - 17 GB (weights + activations) -
    1 GB (context) = 108.9 GB."""
    return int(total * utilization) - peak_torch - non_torch


@torch.inference_mode()
def dummy_step(model: nn.Module, config: ModelConfig, num_tokens: int, num_reqs: int,
               block_size: int, kv_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A forward of `num_tokens` tokens in `num_reqs` requests (logits and softmax of every
    request's last row) over a throwaway two-block cache: every position maps to block 1, so
    the cache stays tiny and writes collide harmlessly. The layers' own caches are put back.
    Returns the probabilities [num_reqs, vocab]."""
    num_reqs = max(1, min(num_reqs, num_tokens))
    per_req = [num_tokens // num_reqs + (r < num_tokens % num_reqs) for r in range(num_reqs)]
    layers = model.attention_layers()  # type: ignore[operator]
    saved = [attn.kv_cache for attn in layers]
    scratch = allocate_kv_caches(config, 2, block_size, kv_dtype, device)
    try:
        for attn, cache in zip(layers, scratch):
            attn.kv_cache = cache
        md, positions = build_attention_metadata(
            [[1] * -(-n // block_size) for n in per_req], [0] * num_reqs, per_req, block_size,
            device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        rows = (torch.tensor(per_req).cumsum(0) - 1).numpy()
        with set_forward_context(md):
            _, logits = model.forward_logits(  # type: ignore[operator]
                ids, torch.from_numpy(positions).to(device), rows, only_rows=True)
        return torch.softmax(logits.float(), dim=-1)  # the sampler's largest temporary
    finally:
        for attn, cache in zip(layers, saved):
            attn.kv_cache = cache


def profile_kv_cache_memory(
    model: nn.Module, config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
    block_size: int, kv_dtype: torch.dtype, device: torch.device, utilization: float,
) -> int:
    """Bytes the KV cache may take on this GPU (see the module docstring); at least 1."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    dummy_step(model, config, max_num_batched_tokens, max_num_seqs, block_size, kv_dtype, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    budget = kv_budget(total, utilization, peak, non_torch)
    logger.info("GPU memory: %.2f GiB total x %.2f utilization - %.2f GiB peak of a "
                "%d-token step - %.2f GiB outside torch = %.2f GiB for the KV cache",
                total / 2**30, utilization, peak / 2**30, max_num_batched_tokens,
                non_torch / 2**30, budget / 2**30)
    if budget <= 0:
        raise MemoryError(
            f"no GPU memory is left for the KV cache at gpu_memory_utilization {utilization} "
            f"(peak {peak} bytes, outside torch {non_torch}, total {total}): raise it, or "
            "lower max_num_batched_tokens / max_num_seqs")
    return budget
