"""Engine arguments shared by the LLM class, the CLI and the server."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # .gguf path, HF folder, cached repo id; None = packaged SmolLM2
    dtype: str = "auto"
    quantization: str | None = None  # "fp16" | "int8" | "int4": weight-only linears (loom.quant)
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes; None: half the free memory, capped at need
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | float32 | float16
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    seed: int | None = 0
    chat_template: str | None = None
    served_model_name: str | None = None

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"
