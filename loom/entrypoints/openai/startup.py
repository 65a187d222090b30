"""The one line `loom serve` logs when it is ready: what it serves, how, and where."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from loom.engine.llm_engine import LLMEngine


def _kept(model: nn.Module) -> str:
    """How a GGUF file's own quantization is held (the default): its K-quant super-blocks as
    stored, its other blocks (32-wide formats, IQ4_NL, IQ4_XS) exactly on the int8 grid (IQ4's
    as their 4-bit level indices, Q5_0 / Q5_1's at 5 bits where the kernels take them)."""
    from loom.quant.int8 import IQ4, Q5, Int8Embedding, Int8Linear
    from loom.quant.kquant import KQuantLinear

    grid, kquant = set(), False
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int8Embedding)):
            grid.add(m.bits)
        kquant |= isinstance(m, KQuantLinear)
    held = []
    if kquant:
        held.append("K-quant super-blocks as stored")
    if grid:
        forms = [f for b, f in ((IQ4, "IQ4 as 4-bit level indices"), (Q5, "Q5 at 5 bits"))
                 if b in grid]
        held.append("int8 groups of 32 (" + ", ".join(["exact", *forms]) + ")")
    return " and ".join(held) or "stored"


def _weights(engine: LLMEngine) -> str:
    from loom.hub.files import gguf_tag

    source = engine.source
    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    if source.kind == "gguf":
        fmt = f"GGUF {gguf_tag(source.path.name) or ''}".rstrip()
    else:
        fmt = "safetensors"
    quant = engine.loaded.quantization
    if quant is None:
        how = f"run in {dtype}"
    elif quant == "int8" and source.kind == "gguf" and engine.args.quantization is None:
        how = f"kept as {_kept(engine.loaded.model)}, {dtype} activations"
    else:
        how = f"quantized to {quant}, {dtype} activations"
    return (f"{source.path.name} ({engine.model_config.architecture}, {fmt} weights {how}, "
            f"context {engine.scheduler_config.max_model_len})")


def _kernels(engine: LLMEngine) -> str:
    k = engine.loaded.kernels
    if k is None:
        return f"torch ops on {engine.args.resolved_device()} (no CPU C kernels)"
    return k.summary()


def startup_line(engine: LLMEngine, host: str, port: int) -> str:
    """`Loom serves NAME at URL | model ... | kernels ... | KV cache ...`."""
    block = engine.scheduler.block_size
    tokens = (engine.num_blocks - 1) * block  # block 0 is the null block
    kv = str(engine.kv_dtype).removeprefix("torch.")
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    return (f"Loom serves {engine.model_name} at {url} (chat page {url}/, engine view "
            f"{url}/dashboard) | model: {_weights(engine)} | kernels: {_kernels(engine)} | "
            f"KV cache: {tokens} tokens ({engine.num_blocks - 1} blocks of {block}, {kv}), "
            f"prefix caching {'on' if engine.scheduler.kv_cache_manager.enable_caching else 'off'}")
