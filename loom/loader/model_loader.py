"""Build a model on the meta device, materialize it on the target device, load its weights."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from loom.heap import trim as trim_heap
from loom.config import ConfigError, ModelConfig
from loom.loader import gguf as gguf_loader
from loom.loader import pagein
from loom.loader.hugepages import HugePager, copies_allowed
from loom.loader.hf import iter_safetensors, model_config_from_hf
from loom.loader.release import (
    drop_pages, huge_pager, map_spans, populate_pages, release_unused,
)
from loom.loader.resolve import ModelSource
from loom.models.registry import get_model_class
from loom.kernels import select
from loom.kernels.dispatch import KernelChoice, KernelChoiceError
from loom.layers.embedding import KQuantEmbedding
from loom.layers.linear import Linear
from loom.layers.recurrent import RecurrentMixer
from loom.quant.base import EMBED, HEAD, QUANT_METHODS, quantize_model_, replace_module
from loom.quant.fp16 import Fp16Linear, fp16_available
from loom.quant.gguf_dequant import groupable
from loom.quant.gptq import Int4Checkpoint
from loom.quant.int8 import GROUP, Q5, Int8Embedding, Int8Linear, Q8Groups, grouped_available
from loom.quant.kquant import KBlocks, KQuantLinear
from loom.quant.kquant import native as kquant_native

logger = logging.getLogger(__name__)

# None: the checkpoint's own (default_quantization); "none": weights in the activations' dtype
QUANTIZATIONS = ("none", *QUANT_METHODS)
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # GGUF tensor types that are not quantized
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """auto = float32 on CPU, bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    load_seconds: float
    quantization: str | None = None  # what ran: a QUANT_METHODS name, or None (weights in dtype)
    kernels: KernelChoice | None = None  # the CPU kernels (loom.kernels.dispatch), on the CPU
    huge_pages: HugePager | None = None  # puts the weights on huge pages while idle, on the CPU

    def default_kv_cache_dtype(self) -> torch.dtype | None:
        """What kv_cache_dtype "auto" means beside these weights: with int8 weights on the CPU
        kernels (fp32 activations), the kernels' choice (int8, which meets the accuracy bar)
        where head_dim is a multiple of 32, but fp16 for models with q/k norms, where int8 does
        not (Gemma 3 270M: 96.8% teacher-forced top-1 with it, fp16 as fp32; docs/kquants.md)
        and for other head sizes: half the bytes of fp32, read by the same C attention. Else
        None, the model's dtype."""
        if self.kernels is None or self.quantization != "int8" or self.dtype != torch.float32:
            return None
        if self.config.head_dim % GROUP or self.config.qk_norm:
            return torch.float16
        return getattr(torch, self.kernels.kv_cache_dtype)


def default_quantization(reader: object, device: torch.device, dtype: torch.dtype) -> str | None:
    """What `quantization=None` runs (the checkpoint's own): a GGUF file whose linear layers are
    all in 32-wide block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), IQ4_XS or K-quants (Q2_K
    to Q6_K) keeps them as they are on the CPU with fp32 activations ("int8": the 32-wide
    blocks and IQ4_XS's sub-blocks on Loom's int8 grid, exact; the K-quants as stored,
    loom.quant.kquant);
    anything else runs in `dtype` (None), said in one log line where the file is quantized."""
    if reader is None:
        return None
    # every matrix, a mixture's experts each as the one the loader reads (a file of F16 dense
    # layers and Q4_K experts keeps its experts)
    matrices = [m for m in gguf_loader.matrices(reader) if len(m[2]) == 2]
    linear = {qtype.name for name, qtype, _ in matrices
              if name not in (EMBED + ".weight", HEAD + ".weight")}
    quantized = linear - set(FLOAT_TYPES)
    if not quantized:
        return None
    native = {qtype.name for _, qtype, shape in matrices
              if groupable(qtype, shape) or kquant_native(qtype, shape)}
    if quantized <= native and dtype == torch.float32 and grouped_available(device, GROUP):
        return "int8"
    others = ", ".join(sorted(quantized - native)) or ", ".join(sorted(quantized))
    why = (f"{others} have no native kernel yet" if quantized - native
           else "Loom's native blocks run on the CPU with float32 activations only")
    logger.warning("GGUF weights in %s: %s, so they are expanded to %s (the reference path); "
                   "--quantization int8 re-quantizes them to 8-bit groups of 32 instead",
                   ", ".join(sorted(quantized)), why, dtype)
    return None


Weights = Callable[[], Iterator[tuple[str, torch.Tensor | Q8Groups | KBlocks]]]


def _open(source: ModelSource, reader: object, q8: bool = False, kq: frozenset[str] = frozenset(),
          five: bool = True) -> tuple[ModelConfig, Weights, dict[str, int]]:
    """(config, a function yielding the weights, the names it yields as int8 groups -> their
    bits a weight), from a GGUF file's `reader` (its header read once) or a Hugging Face
    folder. `q8`: yield 32-wide GGUF block formats as int8 groups (Q5_0 / Q5_1 5 bits a weight
    where `five`, else 8); `kq`: the K-quant tensors to yield as their blocks."""
    if source.kind == "gguf":
        config = gguf_loader.model_config_from_gguf(reader, source.path)
        arch = gguf_loader.gguf_architecture(reader)
        grouped = gguf_loader.q8_tensors(reader, five) if q8 else {}
        return config, lambda: gguf_loader.iter_gguf_tensors(reader, config, arch, q8, kq,
                                                             five), grouped
    return model_config_from_hf(source.path), lambda: iter_safetensors(source.path), {}


def _sources(model: nn.Module, name: str) -> list[str]:
    """The checkpoint weights a linear layer `name` loads from (several for a packed one; the
    model's own answer where it has one: rows split from another tensor)."""
    own = model.checkpoint_sources(name) if hasattr(model, "checkpoint_sources") else None
    if own is not None:
        return own
    parent, _, leaf = name.rpartition(".")
    frags = [frag for frag, (packed, _) in model.packed_modules.items() if packed == leaf]
    return [f"{parent}.{frag}.weight" for frag in frags] or [f"{name}.weight"]


def _empty_int8_(model: nn.Module, config: ModelConfig, grouped: dict[str, int],
                 kq: frozenset[str] = frozenset()) -> None:
    """int8 loaded straight into its layers, never whole in fp32: every linear the grouped
    kernel takes becomes an empty Int8Linear (its `load_rows` copies checkpoint groups or
    quantizes float rows), 4 bits a weight where all its sources are 4-bit GGUF blocks of one
    kind (Q4_0/Q4_1's values, or IQ4_NL/IQ4_XS's level indices), 5 where they are Q5_0/Q5_1's
    (or those and Q4_0/Q4_1's), else 8. The
    token embedding, and the output projection, become int8 only when the checkpoint already
    holds them on the grid (GGUF block formats: exact); otherwise they stay float and the head
    takes fp16 later (quantize_model_). A linear with a K-quant source among `kq` (and an
    untied K-quant head) becomes a KQuantLinear, each source in its own format."""
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and (name != HEAD or not config.tie_word_embeddings) and any(
                s in kq for s in _sources(model, name)):
            replace_module(model, name, KQuantLinear(m.in_features, m.out_features,
                                                     m.bias is not None))
        elif isinstance(m, nn.Linear) and name != HEAD and m.in_features % GROUP == 0:
            codes = {grouped.get(s) for s in _sources(model, name)}  # 4-bit where all share one
            if codes == {4, Q5}:  # Q4_0/Q4_1's values fit the 5-bit form
                codes = {Q5}
            bits = codes.pop() if len(codes) == 1 and None not in codes else 8
            replace_module(model, name, Int8Linear.empty(m.in_features, m.out_features,
                                                         m.bias is not None, bits=bits))
    vocab, hidden = config.vocab_size, config.hidden_size
    tied = config.tie_word_embeddings
    if EMBED + ".weight" in kq:  # looked up from its blocks; a tied head multiplies by them
        embed = KQuantEmbedding(vocab, hidden)
        replace_module(model, EMBED, embed)
        if tied:
            head = KQuantLinear(hidden, vocab, False)
            head.weight_int8 = embed.weight_int8  # weight_map: the embedding takes the tensor
            head.owns_blocks = False  # the embedding looks rows up in the same blocks
            replace_module(model, HEAD, head)
        return
    if hidden % GROUP:
        return
    if EMBED + ".weight" in grouped:
        embed = Int8Embedding(vocab, hidden, grouped[EMBED + ".weight"])
        replace_module(model, EMBED, embed)
        if tied:
            replace_module(model, HEAD, Int8Linear.empty(hidden, vocab, False, embed.groups))
    if not tied and HEAD + ".weight" in grouped:
        bias = model.get_submodule(HEAD).bias is not None
        replace_module(model, HEAD, Int8Linear.empty(hidden, vocab, bias,
                                                     bits=grouped[HEAD + ".weight"]))


def _interleave(model: nn.Module, reader) -> None:  # noqa: ANN001 (a GGUF reader)
    """Q4_K rows 16 at a time where the kernel build reads them (KQuantLinear.interleave), a
    part at a time: its pages of the file's map faulted in at once before (MADV_POPULATE_READ)
    and dropped after, so the load never holds both copies of the weights (an 8B's peak RSS
    was 2.4 GB above the weights' with the file's pages dropped at the end only)."""
    spans = map_spans(reader)

    def in_map(t: torch.Tensor) -> tuple[int, int] | None:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return (lo, hi) if any(a <= lo and hi <= b for a, b in spans) else None

    def before(t: torch.Tensor) -> None:
        if (span := in_map(t)) is not None:
            populate_pages(*span)

    def after(t: torch.Tensor) -> None:
        if (span := in_map(t)) is not None:
            drop_pages(*span)  # whole pages inside only: a neighbour's stay

    for module in model.modules():
        if isinstance(module, KQuantLinear):
            module.interleave(before, after)


def _log_kquants(model: nn.Module, kernels: KernelChoice | None) -> None:
    """One line naming the K-quant linears kept as stored and their kernel."""
    layers = [m for m in model.modules() if isinstance(m, KQuantLinear)]
    if not layers:
        return
    counts: dict[str, int] = {}
    for m in layers:
        for f in m.formats():
            counts[f] = counts.get(f, 0) + 1
    inter = sum(isinstance(p, KBlocks) and p.interleaved
                for m in layers for _, p in m.parts.values())
    logger.info("GGUF K-quants kept as stored in %d linears (parts: %s%s) on the %s K-quant "
                "kernel", len(layers),
                ", ".join(f"{n} {f}" for f, n in sorted(counts.items())),
                f"; {inter} Q4_K interleaved 16 rows at a time" if inter else "",
                kernels.kquant if kernels is not None else "?")


def _materialize(
    model: nn.Module, device: torch.device, dtype: torch.dtype,
    linear_dtype: torch.dtype | None = None,
) -> None:
    """Give every meta parameter and buffer uninitialized memory (floating ones in `dtype`, the
    weights of linear layers in `linear_dtype` when given); a parameter shared by two modules
    (tied embeddings) stays shared, in the dtype of the first module that holds it.

    Direct `torch.empty` per tensor: `Module.to_empty` + `.to(dtype)` goes through torch's
    Python reference implementations and a second pass (~0.8 s for SmolLM2)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in made:
                    p_dtype = dtype
                    if (linear_dtype is not None and isinstance(module, nn.Linear)
                            and name == "weight"):
                        p_dtype = linear_dtype
                    made[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=p_dtype, device=device), requires_grad=False
                    )
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                b_dtype = dtype if b.is_floating_point() else b.dtype
                module._buffers[name] = torch.empty(b.shape, dtype=b_dtype, device=device)


def _select_kernels(device: torch.device, name: str, batch_invariant: bool
                    ) -> KernelChoice | None:
    """The CPU kernels this process runs (loom.kernels.select, said in the log); None off the
    CPU, where `name` must stay "auto"."""
    if device.type != "cpu":
        if name != "auto":
            raise ConfigError(f"cpu_kernels {name!r} needs the CPU, not {device.type}")
        return None
    try:
        kernels = select(name, batch_invariant)
    except KernelChoiceError as e:
        raise ConfigError(str(e)) from None
    if kernels is not None:
        logger.info(kernels.describe())
    return kernels


def _quantize(model: nn.Module, quantization: str, kernels: KernelChoice | None,
              keep_float: bool = False) -> None:
    """quantize_model_, then give the int8 linears `kernels`' batch and decode kernels."""
    quantize_model_(model, quantization, keep_float)
    # Beside the quantized kernels the oneDNN fp32 path was slower end to end, though faster
    # alone (docs/cpu_kernels.md); the remaining fp32 linears keep F.linear.
    for module in model.modules():
        if isinstance(module, Linear):
            module.onednn = False
        if isinstance(module, (Int8Linear, Int8Embedding)) and module.grouped and \
                kernels is not None:
            module.drop_symmetric_mins()  # the kernels form them: ~1 bit a weight less memory
        if isinstance(module, Int8Linear) and module.grouped and kernels is not None:
            module.batch_kernel = kernels.batch
            if kernels.decode == "vnni":
                module.use_vnni()
        if isinstance(module, KQuantLinear) and kernels is not None:
            module.batch_kernel = kernels.kquant_batch
    head = getattr(model, HEAD, None)
    if isinstance(head, Int8Linear) and head.grouped:
        head.reuse_output = True  # logits live until the next step (the runner's use)
    if isinstance(head, Fp16Linear) and kernels is not None and kernels.batch_invariant:
        head.row_by_row = True  # fbgemm's bits depend on the rows beside (loom.quant.fp16)
    refusal = model.c_stack_refusal() if quantization == "int8" else None
    if refusal is not None:  # said at load, never a silent fallback
        logger.warning("quantization int8: Loom's one-call C decoder stack cannot run %s; "
                       "this model runs layer by layer (int8 linears, per-op kernels)", refusal)


def load_model(
    source: ModelSource, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
    progress: bool = False, quantization: str | None = None, cpu_kernels: str = "auto",
    batch_invariant: bool = False,
) -> LoadedModel:
    """Build, materialize and load a model. `quantization`: None keeps the checkpoint's own
    (default_quantization: a GGUF file's 32-wide blocks as they are, on the CPU), "none" runs
    the weights in `dtype` (the reference), "int8", "int4" or "fp16" convert the linear layers
    to weight-only quantized ones (see loom.quant). On the CPU, `cpu_kernels` and
    `batch_invariant` choose the C kernels (loom.kernels.dispatch; "auto": the best this CPU
    runs)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"unsupported quantization {quantization!r}; choose from {QUANTIZATIONS}")
    start = time.perf_counter()
    pagein.readahead(source.path)  # `loom serve` started it before importing torch
    device = torch.device(device)
    kernels = _select_kernels(device, cpu_kernels, batch_invariant)
    torch_dtype = resolve_dtype(dtype, device)
    reader = gguf_loader.open_gguf(source.path) if source.kind == "gguf" else None
    requested = quantization
    if quantization is None:
        quantization = default_quantization(reader, device, torch_dtype)
    elif quantization == "none":
        quantization = None
    if quantization in ("int4", "fp16") and device.type != "cpu":
        raise ConfigError(
            f"quantization {quantization!r} runs on the CPU only, not on {device.type}"
        )
    if quantization == "fp16" and not fp16_available():
        raise ConfigError("quantization 'fp16' needs torch's fbgemm kernels (x86 CPUs)")
    # int8 on Loom's CPU kernel loads into its int8 layers directly (GGUF groups exactly).
    direct_int8 = (quantization == "int8" and torch_dtype == torch.float32
                   and grouped_available(device, GROUP))
    # the checkpoint's own (no --quantization): K-quant linears stay in their blocks
    kq = frozenset(gguf_loader.kq_tensors(reader)) if (
        direct_int8 and requested is None and reader is not None) else frozenset()
    config, weight_iter, grouped = _open(source, reader, q8=direct_int8, kq=kq,
                                         five=kernels is None or kernels.five_bit)
    model_cls = get_model_class(config)
    with torch.device("meta"):
        model = model_cls(config)
    packed = getattr(model, "packed_modules", {})
    int4 = Int4Checkpoint.from_folder(source.path) if source.kind == "hf" else None
    if int4 is not None:  # GPTQ / AWQ: their INT4 linears as stored (loom/quant/gptq.py)
        if quantization is not None:
            raise ConfigError(f"a {int4.method} checkpoint runs its own INT4 weights, not "
                              f"--quantization {quantization}")
        int4.replace_linears(model, packed)
        quantization = int4.method
    if direct_int8:
        _empty_int8_(model, config, grouped, kq)
    # fp16 packing starts from fp16 weights (the same rounding): half the memory meanwhile.
    _materialize(model, device, torch_dtype,
                 linear_dtype=torch.float16 if quantization == "fp16" else None)
    weights = weight_iter()
    if int4 is not None:
        weights = int4.load_stream(model, weights, packed)
    if progress:
        weights = tqdm(weights, desc=f"loading {source.path.name}", unit="tensor", leave=False)
    with torch.no_grad():
        model.load_weights(weights)
    if EMBED + ".weight" in kq and config.tie_word_embeddings:
        # the tied K-quant head (_empty_int8_) multiplies by the embedding's blocks: one table
        model.get_submodule(HEAD).load_rows(None, model.get_submodule(EMBED).blocks)
    model.init_buffers(device)
    if quantization is not None and int4 is None:
        # a GGUF file's own quantization: a linear the grid cannot take (a width that is not
        # a multiple of 32, stored F32/F16 in the file) keeps the file's values in fp32
        _quantize(model, quantization, kernels, keep_float=requested is None and reader is not None)
    model.eval()
    for module in model.modules():  # prompts in the mixers' chunkwise C forms, but for
        if isinstance(module, RecurrentMixer):  # batch-invariant runs (recurrent.py)
            module.chunked = kernels is not None and not kernels.batch_invariant
    if reader is not None and kernels is not None and copies_allowed():
        # not in data-parallel replicas: they share the file's pages, one copy for all
        _interleave(model, reader)
    _log_kquants(model, kernels)
    if reader is not None:  # the file's pages read once at load (converted tensors) go back
        release_unused(reader, model)
    trim_heap()  # conversion temporaries freed inside the heap go back too
    pager = huge_pager(model, reader) if device.type == "cpu" else None
    pagein.wait(source.path)  # the weights the first request reads are in memory (pagein.py)
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %s, quantization %s) in %.2f s", source.path, config.architecture,
                torch_dtype, quantization or "none", seconds)
    return LoadedModel(model, config, torch_dtype, device, seconds, quantization, kernels, pager)
