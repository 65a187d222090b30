"""Build a model on the meta device, materialize it on the target device, load its weights."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from loom.config import ConfigError, ModelConfig
from loom.loader import gguf as gguf_loader
from loom.loader.hf import iter_safetensors, model_config_from_hf
from loom.loader.resolve import ModelSource
from loom.models.registry import get_model_class
from loom.layers.linear import Linear
from loom.quant.base import QUANT_METHODS, quantize_model_
from loom.quant.fp16 import fp16_available

logger = logging.getLogger(__name__)

QUANTIZATIONS = tuple(QUANT_METHODS)
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


def _open(
    source: ModelSource,
) -> tuple[ModelConfig, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """(config, a function yielding the weights), reading a GGUF file's header only once."""
    if source.kind == "gguf":
        reader = gguf_loader.open_gguf(source.path)
        config = gguf_loader.model_config_from_gguf(reader, source.path)
        arch = gguf_loader.gguf_architecture(reader)
        return config, lambda: gguf_loader.iter_gguf_tensors(reader, config, arch)
    return model_config_from_hf(source.path), lambda: iter_safetensors(source.path)


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
            if p is not None:
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
            if b is not None:
                b_dtype = dtype if b.is_floating_point() else b.dtype
                module._buffers[name] = torch.empty(b.shape, dtype=b_dtype, device=device)


def load_model(
    source: ModelSource, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
    progress: bool = False, quantization: str | None = None,
) -> LoadedModel:
    """Build, materialize and load a model; `quantization` ("int8", "int4", "fp16") then converts
    the linear layers to weight-only quantized ones (see loom.quant)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"unsupported quantization {quantization!r}; choose from {QUANTIZATIONS}")
    start = time.perf_counter()
    device = torch.device(device)
    if quantization in ("int4", "fp16") and device.type != "cpu":
        raise ConfigError(
            f"quantization {quantization!r} runs on the CPU only, not on {device.type}"
        )
    if quantization == "fp16" and not fp16_available():
        raise ConfigError("quantization 'fp16' needs torch's fbgemm kernels (x86 CPUs)")
    torch_dtype = resolve_dtype(dtype, device)
    config, weight_iter = _open(source)
    model_cls = get_model_class(config)
    with torch.device("meta"):
        model = model_cls(config)
    # fp16 packing starts from fp16 weights (the same rounding): half the memory meanwhile.
    _materialize(model, device, torch_dtype,
                 linear_dtype=torch.float16 if quantization == "fp16" else None)
    weights = weight_iter()
    if progress:
        weights = tqdm(weights, desc=f"loading {source.path.name}", unit="tensor", leave=False)
    with torch.no_grad():
        model.load_weights(weights)
    model.init_buffers(device)
    if quantization is not None:
        quantize_model_(model, quantization)
        # Beside the quantized kernels the oneDNN fp32 path measured slower end to end (int4,
        # 1 stream: 0.87x), though faster alone; the remaining fp32 linears keep F.linear.
        for module in model.modules():
            if isinstance(module, Linear):
                module.onednn = False
    model.eval()
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s, %s) in %.2f s", source.path, config.architecture, torch_dtype, seconds)
    return LoadedModel(model, config, torch_dtype, device, seconds)
