"""Weight-only quantization of a loaded model's linear layers, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from loom.quant.int4 import Int4Linear, int4_supported
from loom.quant.int8 import Int8Linear

# name -> (quantized module from an nn.Linear, whether a given linear can take it)
QUANT_METHODS: dict[str, tuple[Callable[[nn.Linear], nn.Module], Callable[[nn.Linear], bool]]] = {
    "int8": (Int8Linear, lambda linear: True),
    "int4": (Int4Linear, int4_supported),
}


def quantize_linears_(model: nn.Module, method: str, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace, in place, every nn.Linear the method supports except those named in `skip`;
    returns how many. Unsupported shapes stay unquantized.

    The output projection stays unquantized by default: it is where quantization moves top-1
    agreement most (int8 there: 98.9% -> 96.7% on the SmolLM2 test prompts).
    """
    make, supported = QUANT_METHODS[method]
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name not in skip and supported(m)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(module))
    return len(targets)
