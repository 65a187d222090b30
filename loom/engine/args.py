"""Engine arguments shared by the LLM class, the CLI and the server.

Each field is also a command-line flag of `loom serve`, `loom generate` and `loom bench
throughput`, generated from its `flag(...)` declaration (loom.engine.arg_utils): adding an engine
option is adding a field here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from loom.config import KV_CACHE_DTYPES
from loom.engine.arg_utils import (
    CACHE, KERNELS, MODEL, SCHEDULER, SERVER, flag, positive_float, positive_int,
)

DISTRIBUTED = "distributed"

# `loom serve`'s step budget on the CPU: every running stream waits for a step, so a long prompt
# chunk stalls them all; offline (the LLM class) only throughput counts, and 2048 stays.
SERVE_CPU_BATCHED_TOKENS = 512
# Decode steps a scheduling step runs on the CPU (num_scheduler_steps): the Python around a step
# (~0.6 ms on a 2-core Zen 4: scheduling, inputs, sampling, outputs, mostly cache misses after
# the forward streamed the weights) is ~12% of the 135M's one-stream step
DECODE_STEPS_CPU = 4
# ... and by default only as many as fit this long, so a request arriving meanwhile waits at most
# about this for its prompt's step: steps ahead pay where a step is short (the Python around it
# ~0.6 ms of a 5 ms step), not on 1.7 B+ models (35 ms+ a step, where it is ~2%)
AHEAD_BUDGET_S = 0.04


def chat_template_text(value: str) -> str:
    """--chat-template: the template text itself, or a file holding it."""
    if "{%" in value or "{{" in value:
        return value
    try:
        return Path(value).read_text()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {value}: {e}") from None


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = flag(
        None, "a .gguf file, a Hugging Face folder, a model name pulled with `loom pull` (an "
              "alias such as qwen3:0.6b, org/repo or org/repo:Q8_0), or nothing for the "
              "packaged SmolLM2-135M-Instruct", MODEL)
    dtype: str = flag(
        "auto", "weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA)", MODEL,
        choices=("auto", "float32", "bfloat16", "float16"))
    device: str = flag("auto", "cpu, cuda or auto (cuda when torch sees a GPU)", MODEL)
    seed: int | None = flag(0, "global random seed", MODEL)
    chat_template: str | None = flag(
        None, "a Jinja chat template (file path or the template text) replacing the model's",
        MODEL, type=chat_template_text)
    served_model_name: str | None = flag(
        None, "the model name clients must send in `model` and that /v1/models lists "
              "(default: the model argument, or 'smollm2')", SERVER)

    quantization: str | None = flag(
        None, "weight-only quantized linear layers. Default: the checkpoint's own (a GGUF "
              "file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks stay as they are on the CPU; other "
              "checkpoints run in --dtype); none: weights expanded to --dtype (the float32 "
              "reference on the CPU); int8 (Loom's kernel: groups of 32 with scale and "
              "minimum, fp32 activations; GGUF 4-bit weights kept exactly, others re-quantized), "
              "fp16 (fbgemm, fp32 activations; near lossless), int4 (groups of 32, bf16 "
              "activations) or fp8 (GPU: e4m3 weights with a scale per output channel, "
              "quantized at load; FP8 tensor cores on Ada/Hopper, expanded per call elsewhere)",
        KERNELS, choices=("none", "fp16", "int4", "int8", "fp8"))
    cpu_kernels: str = flag(
        "auto", "the build of Loom's C kernels on the CPU: auto (the best this CPU runs, said "
                "in the log at start-up) or one by name: amx, bf16, vnni, avx512, avx2, "
                "generic (x86), neon, generic (AArch64)", KERNELS,
        choices=("auto", "amx", "bf16", "vnni", "avx512", "avx2", "neon", "generic"))
    batch_invariant: bool = flag(
        False, "a request computes the same bits alone as in any batch: int8 linears on the "
               "fp32 kernel at every batch size, instead of AVX512-BF16/AMX dot products past 8 "
               "rows and AVX512-VNNI ones up to 8 where the CPU has them. Costs about half the "
               "speed of prompts and of steps of many streams on such CPUs, and ~7%% of a "
               "one-stream decode; nothing on CPUs without them", KERNELS)
    enforce_eager: bool = flag(
        False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs (captured at "
               "start-up per batch-size bucket)", KERNELS)
    num_threads: int | None = flag(
        None, "torch CPU threads (default: one per CPU it may use). Loom also defaults "
              "OpenMP to a short spin (OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=1000) unless either "
              "is set; on cores shared with busy processes set OMP_WAIT_POLICY=PASSIVE", KERNELS,
        type=positive_int)

    max_model_len: int | None = flag(
        None, "longest prompt + output in tokens (default: the model's context length)",
        SCHEDULER)
    max_num_seqs: int = flag(256, "most requests in one step", SCHEDULER)
    scheduling_policy: str = flag(
        "fcfs", "fcfs: requests run in arrival order; priority: by each request's `priority` "
                "(lower first, then arrival; vLLM's), a waiting request preempting running ones "
                "of lower priority when it cannot be admitted", SCHEDULER,
        choices=("fcfs", "priority"))
    max_num_batched_tokens: int | None = flag(
        2048, "token budget of one step (prefill chunks + decodes); default 512 on the CPU (a "
              "long prefill step stalls every running stream), 2048 on CUDA", SCHEDULER,
        cli_default=None)
    num_scheduler_steps: int | None = flag(
        None, "decode steps one scheduling step may run: where every scheduled request decodes "
              "greedily (no logprobs, penalties, grammar or draft) and none waits, the runner "
              "runs up to N forwards before returning, each token the argmax of the last "
              "(same tokens, fewer Python round trips; streamed text comes N tokens at a "
              "time). Default 4 on the CPU without tensor or pipeline parallelism, as many of "
              "them as take 40 ms at most (a request arriving meanwhile waits for them), 1 "
              "elsewhere", SCHEDULER, type=positive_int)
    speculative_config: str | None = flag(
        None, "speculative decoding, as a JSON object (vLLM's shape): {\"method\": \"ngram\", "
              "\"num_speculative_tokens\": k, \"prompt_lookup_max\": n, \"prompt_lookup_min\": "
              "m, \"disable_by_batch_size\": b}: each decoding request proposes up to k tokens "
              "that followed an earlier occurrence of its last n..m tokens, checked in one step "
              "(greedy output unchanged, sampled output's distribution unchanged); or "
              "{\"method\": \"draft_model\", \"model\": M, \"num_speculative_tokens\": k}: a "
              "smaller model M with the same vocabulary drafts them; see docs/speculative.md",
        SCHEDULER)

    kv_cache_memory: int | None = flag(
        None, "bytes for the KV cache (default: on CUDA --gpu-memory-utilization's rule, "
              "else half the free memory, capped at need, of which the CPU keeps at most one "
              "context of idle prefix history in memory; set, all of it may hold history)",
        CACHE)
    state_cache_memory: int | None = flag(
        None, "hybrid models (Qwen3.5, LFM2, Granite 4.0-H, ...): bytes for the copies of "
              "requests' states that prefix caching keeps at block boundaries, the newest used "
              "kept (default: 256 MiB, at least 8 requests' states; 0: none, so no prompt of "
              "a hybrid is reused)", CACHE)
    gpu_memory_utilization: float = flag(
        0.9, "CUDA: the share of the GPU's memory Loom takes: the weights, the peak of a "
             "profiled max-size step, and the KV cache in the rest", CACHE,
        type=positive_float)
    kv_cache_dtype: str = flag(
        "auto", "K/V storage: auto (int8 with int8 weights on the CPU kernels, which meets "
                "Loom's accuracy bar there; else the model's dtype), float32, float16 (half "
                "the bytes, like llama.cpp's default) or int8 (groups of 32 with an fp32 scale "
                "and minimum: 62.5%% of float16's bytes), or on CUDA fp8 (e4m3, a scale per "
                "KV head); attention computes in fp32", CACHE,
        choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = flag(
        True, "reuse the KV cache of shared prompt prefixes", CACHE)
    block_size: int = flag(16, "tokens per KV-cache block", CACHE)
    num_gpu_blocks_override: int | None = flag(
        None, "exact number of KV-cache blocks (testing)", CACHE)
    tensor_parallel_size: int = flag(
        1, "split each layer over N processes (torch.distributed: gloo on the CPU, NCCL on one "
           "GPU each): attention heads, MLP width and vocabulary; unquantized weights only. "
           "On the CPU for correctness and multi-socket machines, not speed on one socket",
        DISTRIBUTED, type=positive_int)
    pipeline_parallel_size: int = flag(
        1, "split the layers into N consecutive stages, one process each (torch.distributed "
           "point to point; a step's requests pass as micro-batches, so stages overlap); "
           "Llama, Mistral, Qwen", DISTRIBUTED, type=positive_int)
    distributed_executor_backend: str = flag(
        "mp", "where tensor- or pipeline-parallel ranks other than 0 run: mp (processes on "
              "this machine) or ray (actors placed by a Ray placement group: the cluster of "
              "RAY_ADDRESS or of "
              "`ray start` on this machine, else a local Ray instance)", DISTRIBUTED,
        choices=("mp", "ray"))

    def resolved_max_num_batched_tokens(self, device: str) -> int:
        """The step budget: as given; unset (the CLI's default), SERVE_CPU_BATCHED_TOKENS on
        the CPU and 2048 elsewhere."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return SERVE_CPU_BATCHED_TOKENS if device == "cpu" else 2048

    def resolved_scheduler_steps(self, device: str) -> int:
        """num_scheduler_steps as given; unset, DECODE_STEPS_CPU on the CPU alone (one
        process), 1 elsewhere."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        alone = self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1
        return DECODE_STEPS_CPU if device == "cpu" and alone else 1

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
