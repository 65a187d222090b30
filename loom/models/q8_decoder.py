"""The whole decoder stack of an int8 model in one C call (loom/kernels/csrc/decoder_q8.c).

The C runner walks a description of the layers built here from the model definition itself:
each layer's `stack_parts` (loom/models/llama.py) says which norms, q/k norms, rotary table,
attention window and scale and activation it has, and `LayerQ8` carries them (NULL: absent).
No architecture is named in C: a new one describes its layer in Python (gemma.py) and the stack
runs it. It runs the kernels the per-module path runs, in the same order, on the same buffers'
values: the same bits, without Python between ~300 kernel calls a step. It applies when every
layer's linears are int8 on Loom's kernel or GGUF K-quant blocks (KQuantLinear, its parts in
their own formats: LinearQ8's kinds; a mixture of experts' router, experts and shared expert
among them: MoeQ8), activations are fp32 on the CPU and attention runs on the C kernel; the
model's c_stack_refusal names what it cannot run. A hybrid's layers with a state per request
run their mixers' C decode steps in the call (MixerQ8: each request's rows one after another,
prompts too). Its
linears run the kernels loom.kernels.dispatch gave the modules (loom.quant.int8): past 8 rows
fp32, AMX tiles or bf16 dot products, up to 8 fp32 or VNNI. The call also looks the token ids up
in an int8-grid embedding table and, given the output projection and the rows that sample
(`LlamaForCausalLM.forward_logits`), computes their logits: Python after ~98 MB of weights
streamed through the caches runs cold, so each call it makes costs a step far more than warm.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch
from torch import nn

from loom.attention.backends import cpu_kernel
from loom.attention.forward_context import get_forward_context
from loom.kernels import cpu_kernels, kv_pointers, kv_type
from loom.layers.activation import ACTIVATIONS
from loom.layers.recurrent import StepStates, dry_requests
from loom.layers.router import RouterLinear
from loom.quant.int8 import Int8Embedding, Int8Linear
from loom.quant.kquant import KBlocks, KQuantLinear
from loom.threads import TeamSize

BATCH_CODES = {"fp32": 0, "amx": 1, "bf16": 2, "int16": 3}  # decoder_q8.c's `kernel`, low bits
DECODE_VNNI = 4  # its flag for decode_kernel "vnni"
VNNI_ALL = 16  # ... and for batch_kernel "vnni": the same kernel past 8 rows (AArch64 builds)
KQ_GEMM = 8  # its flag for K-quant linears' batch_kernel past 8 rows (linear_kq_gemm.c)


# loom.h's LOOM_LINEAR_*: a LinearQ8's `kind` (the int8 grid, K-quant blocks, a fused linear's
# parts of different formats)
LINEAR_Q8, LINEAR_KQ, LINEAR_PARTS, LINEAR_F32 = 0, 1, 2, 3


class LinearQ8(ctypes.Structure):  # loom.h's LoomLinearQ8 (its fields below: it points to itself)
    @classmethod
    def of(cls, linear: Int8Linear | Int8Embedding | KQuantLinear) -> LinearQ8:
        """`linear` as the C stack runs it: an int8-grid one; a KQuantLinear of one K-quant
        part; else its parts (K-quant blocks or int8 grid), each with its output columns."""
        if isinstance(linear, RouterLinear):  # fp32 as it is
            return cls(linear.weight.data_ptr(), None, None, None, None, 0, LINEAR_F32, None, 0,
                       0, linear.out_features)
        if isinstance(linear, KQuantLinear):
            parts = list(linear.parts.items())  # in row order
            if len(parts) == 1 and isinstance(parts[0][1][1], KBlocks):
                return cls.part(parts[0][1][1], 0, linear.out_features)
            arr = (cls * len(parts))(*(cls.part(p, n0, n) for n0, (n, p) in parts))
            # the pointer field keeps the array alive (ctypes' _objects), copies of this too
            return cls(None, None, None, None, None, 0, LINEAR_PARTS,
                       ctypes.cast(arr, ctypes.POINTER(cls)), len(parts), 0, linear.out_features)
        half = getattr(linear, "_half", None)
        half = (None, None) if half is None else (
            None if t is None else t.data_ptr() for t in half)
        return cls(linear.weight_int8.data_ptr(), linear.scale.data_ptr(),
                   linear.min_ptr, *half, linear.bits, LINEAR_Q8, None, 0, 0,
                   getattr(linear, "out_features", 0))

    @classmethod
    def part(cls, p: KBlocks | Int8Linear, n0: int, n: int) -> LinearQ8:
        """A fused linear's part writing its output columns [n0, n0 + n)."""
        if isinstance(p, KBlocks):
            return cls(p.data.data_ptr(), None, None, None, None, p.fmt, LINEAR_KQ, None, 0, n0,
                       n)
        q = cls.of(p)
        q.n0, q.n = n0, n
        return q


LinearQ8._fields_ = [(name, ctypes.c_void_p) for name in ("w", "s", "m", "s16", "m16")] + [
    ("bits", ctypes.c_int64), ("kind", ctypes.c_int64), ("parts", ctypes.POINTER(LinearQ8))] + [
    (name, ctypes.c_int64) for name in ("num_parts", "n0", "n")]


class EmbedQ8(ctypes.Structure):  # loom.h's LoomEmbedQ8
    _fields_ = [("table", LinearQ8), ("vocab", ctypes.c_int64), ("ids", ctypes.c_void_p),
                ("scale", ctypes.c_float)]


class HeadQ8(ctypes.Structure):  # loom.h's LoomHeadQ8
    _fields_ = [("w", LinearQ8)] + [
        (name, ctypes.c_int64) for name in ("N", "num_rows", "kernel")] + [
        (name, ctypes.c_void_p) for name in ("rows", "x", "logits")]


_NORMS = ("in_norm", "mlp_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")
# loom.h's LOOM_BLOCK_*: a layer's blocks (stack_parts' `block`; Nemotron-H's layers one each)
BLOCKS = ("both", "mix", "mlp")


class MoeQ8(ctypes.Structure):  # loom.h's LoomMoeQ8
    _fields_ = [("router", LinearQ8), ("gu", ctypes.POINTER(LinearQ8)),
                ("d", ctypes.POINTER(LinearQ8))] + [
        (name, ctypes.c_int64) for name in ("num_experts", "top_k", "norm_topk", "inter")] + [
        (name, LinearQ8) for name in ("shared_gu", "shared_d", "shared_gate")] + [
        ("shared_inter", ctypes.c_int64), ("buf", ctypes.c_void_p), ("max_rows", ctypes.c_int64),
        ("bias", ctypes.c_void_p), ("scale", ctypes.c_float)]

    @classmethod
    def of(cls, block: nn.Module) -> MoeQ8:
        """A SparseMoeBlock (loom/models/moe.py) as the stack runs it; its scratch is set per
        step (Q8Decoder._moe_scratch)."""
        def linears(name: str) -> ctypes.Array:
            return (LinearQ8 * len(block.experts))(
                *(LinearQ8.of(getattr(e, name)) for e in block.experts))

        shared = block.shared_expert
        none = LinearQ8()
        return cls(  # the arrays stay alive in the pointer fields (ctypes' _objects)
            LinearQ8.of(block.gate), linears("gate_up_proj"), linears("down_proj"),
            len(block.experts), block.top_k, int(block.norm_topk_prob),
            block.experts[0].intermediate_size,
            *((none, none, none) if shared is None else (
                LinearQ8.of(shared.gate_up_proj), LinearQ8.of(shared.down_proj),
                none if block.shared_expert_gate is None
                else LinearQ8.of(block.shared_expert_gate))),
            0 if shared is None else shared.intermediate_size, None, 0,
            block.expert_bias.data_ptr() if block.sigmoid else None,
            block.scaling if block.sigmoid else 1.0)

    def widest(self) -> int:
        """The wider of its experts' and its shared expert's MLPs."""
        return max(self.inter, self.shared_inter)


_MIXER_PTRS = ("conv_state", "ssm_state", "conv_w", "conv_b", "a_log", "dt_bias", "d",
               "norm_w")
_MIXER_DIMS = ("key_heads", "value_heads", "dk", "dv", "width", "norm_groups", "tiled",
               "chunked")


class MixerQ8(ctypes.Structure):  # loom.h's LoomMixerQ8
    _fields_ = [("in_proj", LinearQ8), ("out_proj", LinearQ8), ("in_b", ctypes.c_void_p),
                ("out_b", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("kind", "proj_n", "out_k")] + [
        (name, ctypes.c_void_p) for name in _MIXER_PTRS] + [
        (name, ctypes.c_int64) for name in _MIXER_DIMS] + [
        (name, ctypes.c_float) for name in ("eps", "dt_min", "dt_max")] + [
        ("scratch", ctypes.c_void_p), ("max_rows", ctypes.c_int64), ("dry", ctypes.c_void_p),
        ("record", ctypes.c_void_p), ("record_rows", ctypes.c_int64)]

    @classmethod
    def of(cls, mixer: nn.Module) -> MixerQ8:
        """A hybrid layer's mixer (loom/layers/recurrent.py's RecurrentMixer) as its
        `stack_fields` describe it; its states' pointers (`bind`) and scratch set per step."""
        f = mixer.stack_fields()
        biases = (None if m.bias is None else m.bias.data_ptr()
                  for m in (mixer.in_proj, mixer.out_proj))
        x = cls(LinearQ8.of(mixer.in_proj), LinearQ8.of(mixer.out_proj), *biases, f["kind"],
                mixer.in_proj.out_features, mixer.out_proj.in_features)
        for name in _MIXER_PTRS[2:]:
            t = f.get(name)
            setattr(x, name, None if t is None else t.data_ptr())
        for name in (*_MIXER_DIMS, "eps", "dt_min", "dt_max"):
            setattr(x, name, f.get(name, 0))
        return x

    def bind(self, mixer: nn.Module) -> None:
        """The states the module holds now (the runner allocates them after the first build)."""
        self.conv_state = mixer.states[0].data_ptr()
        self.ssm_state = mixer.states[1].data_ptr() if len(mixer.states) > 1 else None


class LayerQ8(ctypes.Structure):  # loom.h's LoomLayerQ8
    _fields_ = [(name, ctypes.c_void_p) for name in (*_NORMS, "qkv_b", "rope_table")] + [
        ("rope_rows", ctypes.c_int64), ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p)] + [(name, LinearQ8) for name in ("qkv", "o", "gu", "d")] + [
        ("window", ctypes.c_int64), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("act", ctypes.c_int32), ("qk_norm_full", ctypes.c_int32), ("block", ctypes.c_int32),
        ("moe", ctypes.POINTER(MoeQ8)), ("gate", ctypes.POINTER(LinearQ8)),
        ("mixer", ctypes.POINTER(MixerQ8))]

    @classmethod
    def of(cls, parts: dict, rotary: torch.nn.Module) -> LayerQ8:
        """A layer from its `stack_parts` and its rotary table (a hybrid's mixer layers: no
        attention, its mixer instead)."""
        attn, table = parts["attn"], rotary.cos_sin_cache
        norms = [None if parts[n] is None else parts[n].weight.data_ptr() for n in _NORMS]
        bias = None if parts["qkv"] is None else parts["qkv"].bias
        moe, gate, mixer = parts.get("moe"), parts.get("gate"), parts.get("mixer")
        dense = [LinearQ8() if m is None else LinearQ8.of(m)
                 for m in (parts["gate_up"], parts["down"], parts["qkv"], parts["o"])]
        return cls(
            *norms, None if bias is None else bias.data_ptr(), table.data_ptr(), table.shape[0],
            *((None, None) if attn is None else kv_pointers(attn.kv_cache)), dense[2], dense[3],
            *dense[:2], 0 if attn is None else attn.sliding_window or 0,
            0.0 if attn is None else attn.scale, 0.0 if attn is None else attn.softcap or 0.0,
            ACTIVATIONS.index(parts["activation"]), int(parts["qk_norm_full"]),
            BLOCKS.index(parts.get("block", "both")),
            None if moe is None else ctypes.pointer(MoeQ8.of(moe)),
            None if gate is None else ctypes.pointer(LinearQ8.of(gate)),
            None if mixer is None else ctypes.pointer(MixerQ8.of(mixer)),
        )


def _linears(parts: dict) -> list[nn.Module]:
    """A layer's linears: qkv, o (a hybrid's mixer's in_proj and out_proj), then the dense
    MLP's gate_up and down, or its mixture of experts' router, experts' and shared expert's
    (and its gate); then attention's output gate, if any (a one-block layer's: its block's)."""
    mixer, moe, block = parts.get("mixer"), parts.get("moe"), parts.get("block", "both")
    first = ([] if block == "mlp" else [parts["qkv"], parts["o"]] if mixer is None
             else [mixer.in_proj, mixer.out_proj])
    gate = [] if parts.get("gate") is None else [parts["gate"]]
    if block == "mix":
        return [*first, *gate]
    if moe is None:
        return [*first, parts["gate_up"], parts["down"], *gate]
    shared = [] if moe.shared_expert is None else [
        moe.shared_expert.gate_up_proj, moe.shared_expert.down_proj,
        *([] if moe.shared_expert_gate is None else [moe.shared_expert_gate])]
    return [*first, moe.gate, *(m for e in moe.experts for m in (e.gate_up_proj, e.down_proj)),
            *shared, *gate]


def _grouped(m: object, bias_ok: bool = False) -> bool:
    """Whether the stack runs linear `m`: int8-grid groups, or K-quant blocks (KQuantLinear)
    whose parts are each K-quant or int8-grid (fp32 parts: no)."""
    if isinstance(m, RouterLinear):
        return m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    if isinstance(m, KQuantLinear):
        return (bias_ok or m.bias is None) and all(
            isinstance(p, KBlocks) or (isinstance(p, Int8Linear) and p.grouped)
            for _, p in m.parts.values())
    return isinstance(m, Int8Linear) and m.grouped and (bias_ok or m.bias is None)


def eligible(model: torch.nn.Module) -> bool:
    """`model` is a LlamaModel whose layers the C stack can run (weights only: the architecture
    is LlamaForCausalLM.c_stack_refusal's, the step's activations and cache are checked per
    call)."""
    parts = [layer.stack_parts() for layer in model.layers]
    return (
        all(
            p["activation"] in ACTIVATIONS
            and _grouped(_linears(p)[0], bias_ok=True)
            and all(_grouped(m, bias_ok=m is getattr(p.get("mixer"), "out_proj", None))
                    for m in _linears(p)[1:])
            and (p.get("mixer") is None or p["mixer"].stack_fields() is not None)
            for p in parts
        )
        and cpu_kernels() is not None
    )


def _kernel_code(linear: nn.Module) -> int | None:
    """The stack's `kernel` code of an int8-grid linear, or of a KQuantLinear's int8-grid parts
    (None where it has none: the K-quant kernel is the same whatever the code)."""
    if isinstance(linear, RouterLinear):
        return None  # one fp32 kernel
    if isinstance(linear, KQuantLinear):
        codes = {_kernel_code(p) for _, p in linear.parts.values() if isinstance(p, Int8Linear)}
        return codes.pop() if len(codes) == 1 else None if not codes else BATCH_CODES["fp32"]
    if linear.batch_kernel == "vnni":
        return DECODE_VNNI | VNNI_ALL
    return BATCH_CODES[linear.batch_kernel] | (DECODE_VNNI if linear.decode_kernel == "vnni" else 0)


class Q8Decoder:
    """Built once per model; `forward` per step. Holds no weights of its own: pointers into the
    model's parameters and KV caches (rebuilt if the caches are rebound), and the step's scratch
    activations, kept across steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # (a hybrid's first layer may be a mixer's)
        attn0 = next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn"))
        self.attn0 = attn0.attn  # holds the cache every layer's is checked like
        self.num_heads, self.kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_dim = attn0.head_dim
        self.hidden = model.norm.weight.shape[0]
        # the dense MLPs' width (0 where every layer's MLP is a mixture of experts)
        self.inter = max((getattr(getattr(layer, "mlp", None), "intermediate_size", 0)
                          for layer in model.layers), default=0)
        self.eps = model.norm.eps
        self.tile_tokens = cpu_kernel.tile_tokens(self.num_heads, self.kv_heads, self.head_dim)
        embed = model.embed_tokens
        # an empty tensor of the activations' dtype and device (the embeddings')
        self.activation: torch.Tensor
        self.embed: EmbedQ8 | None
        if isinstance(embed, Int8Embedding):  # an int8-grid table is looked up in the call
            self.embed = EmbedQ8(LinearQ8.of(embed), embed.num_embeddings, None,
                                 model.embed_scale)
            self.activation = torch.empty(0)
        else:
            self.embed, self.activation = None, embed.weight[:0]
        self.layers: ctypes.Array | None = None
        self.cache: torch.Tensor | None = None  # the cache the layers point into
        self.ok = False  # whether the kernels take that cache
        self.code = 0  # decoder_q8.c's `kernel`, set with the layers
        self.team: TeamSize | None = None  # the call's thread count (loom.threads.TeamSize)
        self.scratch: list[torch.Tensor] = []  # the stack's activations, grown, never shrunk
        self.moes: list[MoeQ8] = []
        self.moe_buf: torch.Tensor | None = None
        # a hybrid's mixers: (their descriptions, views of the layers', and their modules)
        self.mixers: list[tuple[MixerQ8, nn.Module]] = []
        self.mixer_buf: torch.Tensor | None = None
        self.widths: tuple[int, ...] = ()  # the scratch activations' widths
        self.head_module: torch.nn.Module | None = None  # the output projection `head` runs
        self.head: HeadQ8 | None = None

    def usable(self) -> bool:
        """Whether the stack runs this step (the caches' dtype and layout, checked when the
        runner binds them; a hybrid's: each request's states in its slot, and a dry request's
        head state within the C steps' bound)."""
        cache = self.attn0.kv_cache
        if cache is not self.cache:
            self._build(cache)
        if self.ok and self.mixers:
            md = get_forward_context().attn_metadata
            starts = md.query_starts_host
            return (md.state_slots is not None and len(starts) > 1
                    and (md.state_dry is None or all(m.dry_fits() for _, m in self.mixers)))
        return self.ok

    def _build(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.ok = cpu_kernel.supported(
            self.activation, cache, self.num_heads, self.kv_heads, self.head_dim)
        rotaries = self.model.rotaries()
        parts = [layer.stack_parts() for layer in self.model.layers]
        self.layers = (LayerQ8 * len(parts))(
            *(LayerQ8.of(p, rotaries[p["rope_index"]]) for p in parts))
        # the mixtures of experts' descriptions (views of the layers'), their scratch unset
        self.moes = [layer.moe.contents for layer in self.layers if layer.moe]
        self.mixers = [(layer.mixer.contents, p["mixer"])
                       for layer, p in zip(self.layers, parts) if layer.mixer]
        qkv_n = (self.num_heads + 2 * self.kv_heads) * self.head_dim
        q_n = self.num_heads * self.head_dim
        gates = any(p.get("gate") is not None for p in parts)
        self.widths = (max([qkv_n, *(x.proj_n for x, _ in self.mixers)]),
                       max([q_n, *(x.out_k for x, _ in self.mixers)]),
                       max(2 * self.inter, q_n if gates else 0), self.inter,
                       self.hidden, self.hidden)
        # the loader gives every linear one batch kernel and the fp16 copies (VNNI) all or none;
        # linears set apart by hand run the fp32 kernel, which every build has
        codes = {_kernel_code(m) for p in parts for m in _linears(p)} - {None}
        self.code = codes.pop() if len(codes) == 1 else BATCH_CODES["fp32"]
        # the loader gives every K-quant linear one kernel past 8 rows too
        kq = {m.batch_kernel != "int" for p in parts for m in _linears(p)
              if isinstance(m, KQuantLinear)}
        self.code |= KQ_GEMM if kq == {True} else 0

    def _moe_scratch(self, m: int) -> None:
        """Every mixture of experts' scratch (one buffer: the layers run one at a time) for
        steps of up to m tokens, grown, never shrunk."""
        if not self.moes or self.moes[0].max_rows >= m:
            return
        size = cpu_kernels().loom_moe_scratch_bytes
        self.moe_buf = torch.empty(max(size(m, self.hidden, x.num_experts, x.top_k, x.widest())
                                       for x in self.moes), dtype=torch.uint8)
        for x in self.moes:
            x.buf, x.max_rows = self.moe_buf.data_ptr(), m

    def _mixer_scratch(self, m: int) -> None:
        """The mixers' states as bound now, and their scratch (one buffer: the layers run one
        at a time) for steps of up to m tokens, grown, never shrunk."""
        for x, module in self.mixers:
            x.bind(module)
        if not self.mixers or self.mixers[0][0].max_rows >= m:
            return
        floats = max(module.scratch_floats(m) for _, module in self.mixers)
        self.mixer_buf = torch.empty(max(floats, 1))
        for x, _ in self.mixers:
            x.scratch, x.max_rows = self.mixer_buf.data_ptr(), m

    def _mixer_records(self, md, m: int) -> None:  # noqa: ANN001 (AttentionMetadata)
        """A verify step's dry requests (md.state_dry) for every mixer, and each mixer's record
        of its in_proj rows (its module's `record`, grown, never shrunk); none otherwise."""
        dry = md.state_dry
        for x, module in self.mixers:
            if dry is None:
                x.dry = x.record = None
                continue
            record = module.record
            if record is None or record.shape[0] < m:
                module.record = record = torch.empty(max(m, 16), x.proj_n)
            x.dry, x.record, x.record_rows = dry.ctypes.data, record.data_ptr(), record.shape[0]

    def _scratch(self, m: int) -> list[torch.Tensor]:
        if not self.scratch or self.scratch[0].shape[0] < m:
            # a fresh allocation each step was page-faulted in again
            self.scratch = [torch.empty((m, n)) for n in self.widths]
        return self.scratch

    def _head(self, head: torch.nn.Module) -> HeadQ8 | None:
        """`head` as the call runs it (an int8 linear without bias; else None), built once."""
        if head is not self.head_module:
            self.head_module = head
            code = _kernel_code(head) if _grouped(head) else None
            self.head = HeadQ8(LinearQ8.of(head), head.out_features, 0,
                               self.code if code is None else code | self.code & KQ_GEMM
                               ) if _grouped(head) else None
        return self.head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        head: torch.nn.Module | None = None,
        rows: np.ndarray | None = None,
        only_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions [num_tokens] -> final-normed hidden states [num_tokens, hidden]
        for the step in the forward context, and `head`'s logits of hidden `rows` (int64,
        ascending) [len(rows), vocab] where the head is an int8 linear the call runs too (else
        None). only_rows: the last layer's MLP runs on `rows` alone and the hidden states are
        theirs, [len(rows), hidden] (LlamaModel.forward's `keep`)."""
        assert self.ok, "usable() decides first"
        keep = None
        if only_rows:
            assert rows is not None and rows.dtype == np.int64 and rows.flags.c_contiguous
            keep, rows = rows, np.arange(len(rows), dtype=np.int64)  # the head's: kept rows
        if positions.numel():  # the tables the call reads, filled up to `positions` (the
            # module path's Rope does it); the largest once, in numpy: torch's max and its int(),
            # once a table (Gemma 3 has two), were ~1.7% of a served Gemma 3 engine thread's
            # samples (py-spy); the step's time moved less than the VM's noise
            need = int(positions.numpy().max()) + 1
            for rotary in dict.fromkeys(self.model.rotaries()):
                rotary.ensure_rows(need)
        md = get_forward_context().attn_metadata
        m = input_ids.shape[0]
        buf_qkv, buf_attn, buf_gu, buf_act, head_x, x = self._scratch(m)
        self._moe_scratch(m)
        self._mixer_scratch(m)
        state_slots = (None if not self.mixers
                       else np.ascontiguousarray(md.state_slots, dtype=np.int64))
        if self.mixers:
            fresh = md.state_slots[md.computed == 0]  # (a request's first step: from zero)
            if len(fresh):
                index = torch.from_numpy(fresh)
                for _, module in self.mixers:
                    for t in module.states:
                        t[index] = 0
            if md.state_dry is not None:
                md.state_dry = np.ascontiguousarray(md.state_dry, dtype=np.int8)
            self._mixer_records(md, m)
        buf_h = torch.empty((m, self.hidden))  # returned: the caller's until it lets go
        if self.embed is not None:  # looked up into x, the residual stream
            assert input_ids.dtype == torch.int64 and input_ids.is_contiguous()
            self.embed.ids = input_ids.data_ptr()
            embed = ctypes.byref(self.embed)
        else:
            x, embed = self.model.embed(input_ids), None
        c_head = None if head is None or rows is None or not len(rows) else self._head(head)
        logits = None
        if c_head is not None:
            assert rows.dtype == np.int64 and rows.flags.c_contiguous
            logits = (head._output(len(rows)) if isinstance(head, Int8Linear)
                      else torch.empty((len(rows), head.out_features)))
            c_head.num_rows, c_head.rows = len(rows), rows.ctypes.data
            c_head.x, c_head.logits = head_x.data_ptr(), logits.data_ptr()
            c_head = ctypes.byref(c_head)
        assert x.is_contiguous() and positions.dtype == torch.int64 and positions.is_contiguous()
        threads = torch.get_num_threads()
        if self.team is None or self.team.sizes[0] != threads:
            self.team = TeamSize(threads)
        threads = self.team.choose(m)
        start = time.perf_counter()
        rc = cpu_kernels().loom_decoder_forward_q8(
            ctypes.addressof(self.layers), len(self.layers), self.model.norm.weight.data_ptr(),
            self.hidden, self.inter, self.num_heads, self.kv_heads, self.head_dim,
            self.cache.shape[2], self.eps, embed, m, x.data_ptr(), positions.data_ptr(),
            md.slot_mapping.data_ptr(), md.block_tables.data_ptr(), md.block_tables.shape[1],
            md.query_start_loc.data_ptr(), md.query_start_loc.shape[0] - 1, self.tile_tokens,
            buf_h.data_ptr(), buf_qkv.data_ptr(), buf_attn.data_ptr(), buf_gu.data_ptr(),
            buf_act.data_ptr(), c_head, None if keep is None else keep.ctypes.data,
            -1 if keep is None else len(keep),
            None if state_slots is None else state_slots.ctypes.data, threads,
            kv_type(self.cache), self.code,
        )
        self.team.record(m, time.perf_counter() - start)
        if rc == 0 and self.mixers and md.state_dry is not None:  # the rows a commit runs
            starts = md.query_starts_host
            step = StepStates(starts, np.diff(starts), state_slots, [], md.state_dry)
            dry = dry_requests(step)  # (one view for every mixer: commit binds its states)
            for _, module in self.mixers:
                module.keep_record(module.record[:m], step, dry)
        if rc == -4:  # the module path's IndexError (past the end of a table)
            for rotary in self.model.rotaries():
                rotary.check_positions(positions)
        if rc == -5:
            raise IndexError(f"a token id outside the vocabulary ({self.embed.vocab} tokens)")
        if rc != 0:
            raise RuntimeError(f"int8 decoder kernel failed ({rc})")
        return (buf_h if keep is None else buf_h[: len(keep)]), logits
