"""Engine arguments shared by the LLM class, the CLI and the server."""

from __future__ import annotations

from dataclasses import dataclass

import torch


# `loom serve`'s step budget on the CPU. A step of 2048 prompt tokens takes ~4 s on a 2-core
# CPU, and every running stream waits for it; 512 cut TTFT p50 at 32 streams about in half
# (6263 / 6147 -> 3107 / 3356 ms, 64 requests of 128 + 128 tokens, int8) at the same tokens/s
# (164.7 / 162.8 -> 167.3 / 163.2). The LLM class keeps 2048: offline, only throughput counts.
SERVE_CPU_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # .gguf path, HF folder, cached repo id; None = packaged SmolLM2
    dtype: str = "auto"
    quantization: str | None = None  # "fp16" | "int8" | "int4": weight-only linears (loom.quant)
    # int8's kernel for steps of more than 8 rows: avx (batch-invariant bits), amx (Intel AMX
    # tiles: faster prefill and many streams; loom.quant.int8), bf16 (AVX512-BF16 dot products,
    # bf16 precision) or auto (amx where present, else avx)
    int8_batch_kernel: str = "avx"
    # int8's kernel for steps of up to 8 rows (decode): avx (fp32 x), or vnni (AVX512-VNNI integer
    # dot products, x in two int8 digits a group of 32: near fp32, faster; loom.quant.int8)
    int8_decode_kernel: str = "avx"
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    # Token budget of one step; None: SERVE_CPU_BATCHED_TOKENS on the CPU, 2048 elsewhere.
    max_num_batched_tokens: int | None = 2048
    kv_cache_memory: int | None = None  # bytes; None: half the free memory, capped at need
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | float32 | float16 | int8
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    seed: int | None = 0
    chat_template: str | None = None
    served_model_name: str | None = None

    def resolved_max_num_batched_tokens(self, device: str) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return SERVE_CPU_BATCHED_TOKENS if device == "cpu" else 2048

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"
