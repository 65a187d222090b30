"""Weight-only quantization of a loaded model's linear layers, chosen by name."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from torch import nn

from loom.quant.fp8 import Fp8Linear, fp8_supported
from loom.quant.fp16 import Fp16Linear, fp16_available
from loom.quant.int4 import Int4Linear, int4_supported
from loom.quant.int8 import Int8Linear
from loom.threads import available_cpus

# name -> (quantized module from an nn.Linear, whether a given linear can take it)
QUANT_METHODS: dict[str, tuple[Callable[[nn.Linear], nn.Module], Callable[[nn.Linear], bool]]] = {
    "int8": (Int8Linear, lambda linear: True),
    "int4": (Int4Linear, int4_supported),
    "fp16": (Fp16Linear, lambda linear: True),
    "fp8": (Fp8Linear, fp8_supported),
}
HEAD = "lm_head"
EMBED = "model.embed_tokens"


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def quantize_linears_(model: nn.Module, method: str, skip: tuple[str, ...] = (HEAD,)) -> int:
    """Replace, in place, every nn.Linear the method supports except those named in `skip`;
    returns how many. Unsupported shapes stay unquantized."""
    make, supported = QUANT_METHODS[method]
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name not in skip and supported(m)]
    linears = [m for _, m in targets]
    built = _build_in_threads(make, linears) if make is Fp16Linear else map(make, linears)
    for (name, _), module in zip(targets, built):
        replace_module(model, name, module)
    return len(targets)


def _build_in_threads(make: Callable[[nn.Linear], nn.Module],
                      linears: list[nn.Linear]) -> list[nn.Module]:
    """fbgemm packs fp16 weights on one thread and lets go of the GIL meanwhile: pack on one
    thread per core, biggest first. (The other methods run torch ops that already use every
    core.)"""
    with ThreadPoolExecutor(max_workers=available_cpus()) as pool:
        futures = {i: pool.submit(make, linears[i])
                   for i in sorted(range(len(linears)), key=lambda i: -linears[i].weight.numel())}
        return [futures[i].result() for i in range(len(linears))]


def quantize_model_(model: nn.Module, method: str, keep_float: bool = False) -> None:
    """The decoder's linears take `method`; the output projection takes fp16 where fbgemm runs.
    `keep_float`: the linears still float keep their weights (a GGUF file's own quantization,
    whose float tensors are the file's values: only the head changes).

    The output projection is where quantization moves top-1 agreement most (tests/model/
    test_quant.py), and at one stream it is a large share of a step in fp32. fp16 weights with
    fp32 accumulation keep it near exact at a fraction of the fp32 time.
    A head already int8 (loaded from a GGUF block format, exact: loom.loader.model_loader)
    stays as it is. fp8 (a GPU method) leaves the head in the activations' dtype, as vLLM does.
    """
    head = getattr(model, HEAD, None)
    if method in ("int8", "int4") and isinstance(head, nn.Linear) and fp16_available():
        replace_module(model, HEAD, Fp16Linear(head))
    if not keep_float:
        quantize_linears_(model, method, skip=() if method == "fp16" else (HEAD,))
