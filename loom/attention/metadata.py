"""Attention metadata for one flattened, unpadded batch of tokens from many requests."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


class Workspace:
    """One scratch buffer for the context each layer gathers, reused by every layer and step.

    A fresh tensor per layer would cost a page fault per 4 KiB page each time on the host (glibc
    serves allocations over 32 MiB with a new mmap), several times the gather's own cost at many
    decodes."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialized [shape] tensor; valid until the next `take`."""
        n = math.prod(shape)
        buf = self._buf
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            # Headroom, so contexts growing block by block do not reallocate every step.
            buf = self._buf = torch.empty(n + n // 4, dtype=dtype, device=device)
        return buf[:n].view(shape)


@dataclass
class AttentionMetadata:
    """Everything attention needs to read and write the paged KV cache for one step.

    Request r owns query tokens query_start_loc[r]:query_start_loc[r+1] of the flat batch; after
    this step it has seq_lens[r] tokens of context, the last `query_lens[r]` of them new.
    """

    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot written by each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64 (0 = null block)
    max_query_len: int
    positions: torch.Tensor  # [num_tokens] int64 absolute position of each token
    workspace: Workspace  # the gather buffer; the runner passes one that lasts across steps
    block_size: int
    req_idx: np.ndarray  # [num_tokens] request index of each flat token
    computed: np.ndarray  # [num_reqs] tokens each request had cached before this step
    # Masks built on first use, keyed by sliding window (None = full causal); shared by layers.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # The per-module path's attention tiles (cpu_kernel.step_tiles), built on first use, keyed by
    # tokens per tile; shared by layers. The C decoder stack cuts its own.
    tiles: dict[int, np.ndarray] = field(default_factory=dict)
    # Key-range splits of the Triton decode kernel: fixed by a CUDA graph's capture, None =
    # chosen per step (triton_attn.choose_num_splits).
    num_kv_splits: int | None = None
    # [num_reqs] each request's state slot in a hybrid model's linear layers (the model
    # runner's; loom/layers/gated_delta.py); None: no persistent states this step.
    state_slots: np.ndarray | None = None
    # [num_reqs] int8: the requests of a speculative verify step whose states the step reads
    # but does not write (their kept rows commit after verification); None: none
    state_dry: np.ndarray | None = None

    # Derived on first use, for the torch reference backend (shared by all layers; the C kernels
    # need none of them).
    @cached_property
    def token_req_idx(self) -> torch.Tensor:  # [num_tokens] request index of each flat token
        return self._tensor(self.req_idx)

    @cached_property
    def token_local_idx(self) -> torch.Tensor:  # [num_tokens] position within its query
        return self.positions - self._tensor(self.computed)[self.token_req_idx]

    @cached_property
    def query_positions(self) -> torch.Tensor:  # [num_reqs, max_q] positions of padded queries
        return self._tensor(self.computed[:, None] + np.arange(self.max_query_len)[None, :])

    @cached_property
    def key_positions(self) -> torch.Tensor:  # [max_blocks * block_size]: the gathered keys'
        return self._tensor(np.arange(self.block_tables.shape[1] * self.block_size))

    @cached_property
    def query_starts_host(self) -> np.ndarray:  # [num_reqs + 1] query_start_loc, on the host
        lens = np.bincount(self.req_idx, minlength=len(self.computed))
        starts = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        return starts

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.slot_mapping.device)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """On the host as is; elsewhere staged in pinned memory, so the copy is asynchronous (a copy
    from pageable memory waits for the device's queue first)."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def compute_slot_mapping(
    block_table: np.ndarray, req_idx: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size.

    Example (block_size 4): a request with blocks [7, 3] at positions [4, 5] writes slots
    [3*4+0, 3*4+1] = [12, 13].
    """
    block_ids = block_table[req_idx, positions // block_size]
    return block_ids * block_size + positions % block_size


def build_attention_metadata(
    block_ids: list[list[int]],
    num_computed_tokens: list[int],
    num_scheduled_tokens: list[int],
    block_size: int,
    device: torch.device,
    workspace: Workspace | None = None,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Build metadata for requests that each compute `num_scheduled_tokens[r]` new tokens after
    `num_computed_tokens[r]` already cached ones. Returns (metadata, positions[num_tokens])."""
    num_reqs = len(block_ids)
    query_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)
    computed = np.asarray(num_computed_tokens, dtype=np.int64)
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    max_blocks = max(map(len, block_ids))
    table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for r, ids in enumerate(block_ids):
        table[r, : len(ids)] = ids

    max_q = int(query_lens.max())
    if max_q == 1:  # decode only: token r is request r's
        req_idx, positions = np.arange(num_reqs), computed
    else:
        req_idx = np.repeat(np.arange(num_reqs), query_lens)  # [num_tokens]
        positions = computed[req_idx] + np.arange(num_tokens) - cu[req_idx]
    slot_mapping = compute_slot_mapping(table, req_idx, positions, block_size)
    md = AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=to_device(slot_mapping, device),
        query_start_loc=to_device(cu, device),
        seq_lens=to_device(computed + query_lens, device),
        block_tables=to_device(table, device),
        max_query_len=max_q,
        positions=to_device(positions, device),
        workspace=workspace or Workspace(),
        block_size=block_size,
        req_idx=req_idx,
        computed=computed,
    )
    return md, positions


def next_decode_metadata(md: AttentionMetadata, positions: np.ndarray) -> AttentionMetadata:
    """A decode-only step's metadata (one token a request) for the step after it: each request's
    token one position on (`positions`: md's plus one, numpy, on the host), in the same blocks
    (allocated beforehand). The block table and query starts are shared, the rest new."""
    table = md.block_tables.cpu().numpy() if md.block_tables.device.type != "cpu" \
        else md.block_tables.numpy()
    req_idx = md.req_idx
    slots = compute_slot_mapping(table, req_idx, positions, md.block_size)
    device = md.slot_mapping.device
    return AttentionMetadata(
        num_tokens=md.num_tokens,
        slot_mapping=to_device(slots, device),
        query_start_loc=md.query_start_loc,
        seq_lens=to_device(positions + 1, device),
        block_tables=md.block_tables,
        max_query_len=1,
        positions=to_device(positions, device),
        workspace=md.workspace,
        block_size=md.block_size,
        req_idx=req_idx,
        computed=positions,
        state_slots=md.state_slots,
    )
