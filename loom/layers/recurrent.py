"""What the token mixers of hybrid models share: a state per running request, kept in one slot
of per-layer tensors (the model runner hands each running request a slot; the step's slots are
AttentionMetadata.state_slots), and the causal depthwise convolution whose window of past
inputs is such a state (Gated DeltaNet's, LFM2's short convolution).

A request's slot is zeroed on its first step (no tokens computed), so a slot needs no clearing
when it changes hands; a step without slots (a memory-profiling one) starts every request from
zero and keeps nothing. States are fp32.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loom.attention.forward_context import get_forward_context
from loom.heap import zeros
from loom.kernels import cpu_ops
from loom.layers.linear import Linear


# loom.h's LOOM_MIXER_*: the kind of a mixer the one-call C stack runs (stack_fields)
MIXER_GDN, MIXER_MAMBA2, MIXER_SHORTCONV = 1, 2, 3


def stack_tensors(tensors) -> bool:  # noqa: ANN001 (an iterable of tensors or None)
    """Whether the stack can read these parameters in place: fp32, contiguous, on the CPU
    (None: absent)."""
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous()
                             and t.device.type == "cpu") for t in tensors)


# A dry request's head state in the C decode steps (loom.h's LOOM_MIXER_DRY_FLOATS)
DRY_FLOATS = 65536


@dataclass
class StepStates:
    """One step's view of a mixer's states: each request's rows [starts[r], starts[r + 1]),
    its slot, the state tensors indexed by slot, and which requests are dry (a verify step's
    drafting requests: their states read, not written; None: none)."""

    starts: np.ndarray  # [num_reqs + 1]
    lens: np.ndarray  # [num_reqs]
    slots: np.ndarray  # [num_reqs]
    tensors: list[torch.Tensor]
    dry: np.ndarray | None = None  # [num_reqs] int8

    @property
    def one(self) -> np.ndarray:  # [num_reqs] bool: a request with one row this step
        return self.lens == 1

    def select(self, keep: np.ndarray) -> tuple[np.ndarray, StepStates]:
        """The requests `keep` ([num_reqs] bool) as a step of their own: their rows in this
        step (ascending), and that step's view (rows renumbered from 0)."""
        return self.part(keep, np.zeros(len(self.lens), dtype=np.int64), self.lens)

    def part(self, keep: np.ndarray, lo: np.ndarray, hi: np.ndarray
             ) -> tuple[np.ndarray, StepStates]:
        """As select, each kept request's rows [lo[r], hi[r]) of its own alone."""
        lens = (hi - lo)[keep]
        starts = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        rows = np.repeat(self.starts[:-1][keep] + lo[keep] - starts[:-1], lens) \
            + np.arange(starts[-1])
        dry = None if self.dry is None or not self.dry[keep].any() else self.dry[keep]
        return rows, StepStates(starts, lens, self.slots[keep], self.tensors, dry)


class RecurrentMixer(nn.Module):
    """A token mixer with states per request; `state_shapes` names one slot's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[torch.Tensor] = []  # [slots, *shape] each; allocate_states
        # the last verify step's dry requests' in_proj rows and their view (keep_record)
        self.pending: tuple[torch.Tensor, StepStates] | None = None
        self.record: torch.Tensor | None = None  # the C stack's in_proj rows of a verify step
        # a prompt's rows in the C step's chunkwise form (Gated DeltaNet's, Mamba2's); set at
        # load, off in batch-invariant runs: its bits depend on where a chunk starts, and so
        # on how the prompt was split
        self.chunked = False

    def state_shapes(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def allocate_states(self, slots: int, device: torch.device) -> int:
        """Zeroed states for `slots` requests (loom.heap.zeros: on the host a slot's pages are
        committed only when a request first uses it); returns their bytes."""
        self.states = [zeros((slots, *shape), torch.float32, device)
                       for shape in self.state_shapes()]
        return slots * self.slot_bytes()

    def slot_bytes(self) -> int:
        """One request's states in this layer."""
        return 4 * sum(math.prod(shape) for shape in self.state_shapes())

    def step_states(self, device: torch.device) -> StepStates:
        """This step's requests, slots and states, fresh requests' slots zeroed."""
        md = get_forward_context().attn_metadata
        starts = md.query_starts_host  # (host data: no device sync; once a step)
        lens = np.diff(starts)
        slots = md.state_slots
        if slots is None:  # fresh states, dropped after the step
            slots = np.arange(len(lens))
            tensors = [torch.zeros(len(lens), *shape, device=device)
                       for shape in self.state_shapes()]
            return StepStates(starts, lens, slots, tensors)
        fresh = slots[md.computed == 0]
        if len(fresh):
            index = torch.from_numpy(fresh).to(device)
            for t in self.states:
                t[index] = 0
        return StepStates(starts, lens, slots, self.states, md.state_dry)

    def dry_fits(self) -> bool:
        """Whether a dry request's head state fits the C decode step's (DRY_FLOATS)."""
        return True

    def mix_rows(self, proj: torch.Tensor, step: StepStates) -> torch.Tensor:
        """in_proj's rows [num_tokens, ...] -> the mixer's output before its out projection:
        `_fused` (a C step: each request's rows one after another, token by token, a prompt's
        in the chunkwise form where `chunked`: docs/models.md) on the CPU in fp32 with the
        slots' states, else `_torch`. A verify step's dry requests' rows are kept for
        `commit`."""
        if step.dry is not None:
            self.keep_record(proj, step)
        if (cpu_ops.usable(proj) and step.tensors is self.states
                and (step.dry is None or self.dry_fits())):
            return self._fused(proj, step)
        return self._torch_dry(proj, step)

    def _torch_dry(self, proj: torch.Tensor, step: StepStates) -> torch.Tensor:
        """_torch(proj, step), a dry request's rows on copies of its states."""
        if step.dry is None:
            return self._torch(proj, step)
        dry = step.dry.astype(bool)
        out = None
        for keep in (~dry, dry):
            if not keep.any():
                continue
            rows, part = step.select(keep)
            if keep is dry:  # its own copies, slots 0..n-1
                index = torch.from_numpy(part.slots).to(proj.device)
                part = StepStates(part.starts, part.lens, np.arange(len(part.lens)),
                                  [t[index] for t in part.tensors])
            part.dry = None
            y = self._torch(proj[torch.from_numpy(rows).to(proj.device)], part)
            if out is None:
                out = y.new_empty(proj.shape[0], y.shape[1])
            out[torch.from_numpy(rows).to(proj.device)] = y
        assert out is not None
        return out

    def keep_record(self, proj: torch.Tensor, step: StepStates,
                    dry: tuple[np.ndarray, StepStates] | None = None) -> None:
        """A verify step's in_proj rows of its dry requests, and their view (`dry`: those
        already selected), for `commit`."""
        assert step.dry is not None
        rows, part = dry or dry_requests(step)
        self.pending = (proj[torch.from_numpy(rows).to(proj.device)], part)

    def commit(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """The last verify step's dry requests (in its order) keep their rows [lo[r], hi[r])
        (rows before lo[r] committed already): those run on their states (outputs dropped),
        which then stand as one-row steps would have left them."""
        assert self.pending is not None, "no verify step to commit"
        proj, step = self.pending
        rows, part = step.part(hi > lo, lo, hi)
        part.tensors = self.states
        proj = proj[torch.from_numpy(rows).to(proj.device)]
        if cpu_ops.usable(proj):
            self._fused(proj, part, out=False)
        else:
            self._torch(proj, part)


def dry_requests(step: StepStates) -> tuple[np.ndarray, StepStates]:
    """A verify step's dry requests as a step of their own (not dry), and their rows."""
    assert step.dry is not None
    rows, part = step.select(step.dry.astype(bool))
    part.dry = None
    return rows, part


def state_bytes(model: nn.Module) -> int:
    """One request's states over a model's layers with a state per request (0 for others)."""
    layers = model.recurrent_layers() if hasattr(model, "recurrent_layers") else []
    return sum(layer.slot_bytes() for layer in layers)


def causal_conv(x: torch.Tensor, step: StepStates, window_state: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu: bool = False) -> torch.Tensor:
    """The causal depthwise convolution (weight [channels, width], `bias` [channels]) of each
    request's rows of x [num_tokens, channels] (fp32), its last width - 1 inputs from
    window_state [slots, channels, width - 1] (then replaced by its newest ones); SiLU after
    where `silu`. One-row requests run at once."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    one = step.one
    if one.any():
        rows = torch.from_numpy(step.starts[:-1][one]).to(x.device)
        index = torch.from_numpy(step.slots[one]).to(x.device)
        window = torch.cat([window_state[index], x[rows, :, None]], dim=-1)  # [R, C, width]
        out[rows] = (window * weight).sum(-1)
        window_state[index] = window[..., 1:]
    for r in np.flatnonzero(~one):
        lo, hi, slot = int(step.starts[r]), int(step.starts[r + 1]), int(step.slots[r])
        window = torch.cat([window_state[slot], x[lo:hi].T], dim=-1)  # [C, width - 1 + n]
        out[lo:hi] = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0].T
        window_state[slot] = window[:, window.shape[1] - (width - 1):]
    if bias is not None:
        out += bias
    return F.silu(out) if silu else out


class DepthwiseConv(nn.Module):
    """A causal depthwise convolution's weight [channels, width] (checkpoints' conv1d.weight
    [channels, 1, width], squeezed at load) and optional bias."""

    def __init__(self, channels: int, width: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, width))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None


class ShortConv(RecurrentMixer):
    """LFM2's token mixer: in_proj gives B, C and x; the output is
    out_proj(C * conv(B * x)), conv a causal depthwise convolution whose last width - 1
    inputs are the request's state."""

    def __init__(self, hidden_size: int, width: int, bias: bool) -> None:
        super().__init__()
        self.hidden_size, self.width = hidden_size, width
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = DepthwiseConv(hidden_size, width, bias)
        self.out_proj = Linear(hidden_size, hidden_size, bias=bias)

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.hidden_size, self.width - 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]; each request's window advances by
        its tokens; mix_rows picks the C step or the torch path."""
        proj = self.in_proj(x).float()
        step = self.step_states(x.device)
        y = self.mix_rows(proj, step)
        return self.out_proj(y.to(x.dtype))

    def stack_fields(self) -> dict | None:
        """What the one-call C stack runs this mixer from on decode steps (loom.h's
        LoomMixerQ8; q8_decoder.MixerQ8), or None where its weights are not fp32 on the CPU."""
        tensors = dict(conv_w=self.conv.weight, conv_b=self.conv.bias)
        if not stack_tensors(tensors.values()):
            return None
        return dict(kind=MIXER_SHORTCONV, **tensors, width=self.width)

    def scratch_floats(self, rows: int) -> int:
        return 0  # (none)

    def _fused(self, proj: torch.Tensor, step: StepStates, out: bool = True
               ) -> torch.Tensor | None:
        """The C decode step of `step`'s requests' in_proj rows -> [rows, hidden]."""
        return cpu_ops.shortconv_decode(proj, step.slots, step.tensors[0], self.conv.weight,
                                        self.conv.bias, step.starts, step.dry, out)

    def _torch(self, proj: torch.Tensor, step: StepStates) -> torch.Tensor:
        """in_proj's rows [num_tokens, 3 hidden] of `step`'s requests -> C * conv(B * x)
        [num_tokens, hidden] (fp32), in torch's ops."""
        b, c, h = proj.chunk(3, dim=-1)
        bias = None if self.conv.bias is None else self.conv.bias.float()
        return c * causal_conv(b * h, step, step.tensors[0], self.conv.weight.float(), bias)


class StateSnapshots:
    """Prefix caching for a hybrid model: copies of a request's states at block boundaries,
    keyed by the hash of the block that ends there (the KV cache's), newest used kept within
    `budget` bytes. The scheduler ends prefill chunks on a prompt's last block boundary and
    names the steps that end on one (SchedulerOutput.state_keys); a prefix hit is cut back to
    the last block with a snapshot, which a request's slot starts from (NewRequestData's
    state_key).

    At most `budget // one request's states` copies, each allocated when first needed and
    then reused, never freed (the lowest free one taken first): the memory held for them stays
    within the most in use at once, where a fresh allocation a snapshot (one every block a
    running request decodes) left the heap to grow past them. (One buffer allocated at once
    was tried: its pages, committed by the first copy into each, cost the first requests of a
    Granite-4.0-H-1B ~0.7 s of page faults, where malloc hands out pages the prompts'
    temporaries left committed.)"""

    def __init__(self, layers: list[RecurrentMixer], budget: int) -> None:
        self.tensors = [t for layer in layers for t in layer.states]  # (allocated already)
        per = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self.capacity = max(budget // per, 0) if per else 0
        self.entries: list[list[torch.Tensor]] = []  # a copy of each state tensor's slot
        self.free: list[int] = []  # a heap of the entries holding nothing: the lowest first
        self.store: OrderedDict[object, int] = OrderedDict()  # key -> entry, oldest used first
        self.demoted: OrderedDict[object, None] = OrderedDict()  # the first to go, in order

    def __contains__(self, key: object) -> bool:
        return key in self.store

    def save(self, key: object, slot: int) -> None:
        if self.capacity <= 0:
            return
        if key in self.store:
            self._used(key)
            return
        if not self.free and len(self.entries) < self.capacity:
            self.entries.append([torch.empty_like(t[0]) for t in self.tensors])
            self.free.append(len(self.entries) - 1)
        elif not self.free:
            self.drop(next(iter(self.demoted or self.store)))
        entry = heapq.heappop(self.free)
        for dst, src in zip(self.entries[entry], self.tensors):
            dst.copy_(src[slot])
        self.store[key] = entry

    def drop(self, key: object) -> None:
        entry = self.store.pop(key, None)
        self.demoted.pop(key, None)
        if entry is not None:
            heapq.heappush(self.free, entry)

    def demote(self, key: object) -> None:
        """The key's snapshot among the first to go when room is needed (the demoted ones in
        the order they were, before any other), until it is used again."""
        if key in self.store:
            self.demoted[key] = None

    def _used(self, key: object) -> None:
        self.store.move_to_end(key)
        self.demoted.pop(key, None)

    def restore(self, key: object, slot: int) -> None:
        entry = self.store[key]
        self._used(key)
        for dst, src in zip(self.tensors, self.entries[entry]):
            dst[slot].copy_(src)
