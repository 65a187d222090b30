"""K-quant linears past 8 rows: the default kernel (csrc/linear_kq_gemm.c) against the integer
kernel in chunks of 8 rows (what ran before, and what --batch-invariant runs), on one loaded
model in one process, interleaved rounds, medians.

    .venv/bin/python benchmarks/bench_kq_gemm.py MODEL.gguf [--prompt 128 --streams 16
        --tokens 16 --rounds 3 --threads N]

Prompt: LLM.generate of one fresh random `--prompt`-token prompt, one output token (~TTFT; a
new prompt each round: no prefix-cache hit). Streams: `--streams` random 16-token prompts added
to the engine, stepped until each has a token, then `--tokens` engine steps timed one by one:
their median is a decode step of all streams (~TPOT), and streams / step their tokens a second.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from loom.engine.llm import LLM
from loom.quant.kquant import KQuantLinear
from loom.sampling_params import SamplingParams


def set_kernel(llm: LLM, kernel: str) -> None:
    """Every K-quant linear's kernel past 8 rows; the C stack rebuilds its codes."""
    model = llm.engine.runner.model
    for m in model.modules():
        if isinstance(m, KQuantLinear):
            m.batch_kernel = kernel
    stack = getattr(model.model, "stack", None)
    if stack:
        stack.cache = None  # rebuilt (with its `kernel` code) on the next step
        stack.head_module = None


def decode_step(llm: LLM, streams: list[list[int]], params: SamplingParams) -> float:
    """The median time of an engine step once every stream has its first token."""
    engine = llm.engine
    for i, p in enumerate(streams):
        engine.add_request(f"bench-{id(p)}-{i}", p, params)
    started = set()
    while len(started) < len(streams):
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    times = []
    for _ in range(params.max_tokens - 1):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch's (the kernels') threads")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model)
    default = llm.engine.runner.model.model.layers[0].self_attn.o_proj
    kernels = {f"default ({getattr(default, 'batch_kernel', '?')} past 8 rows)":
               getattr(default, "batch_kernel", "int"), "integer in chunks of 8 (before)": "int"}
    vocab = llm.engine.runner.model_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, min(vocab, 30000)) for _ in range(length)] for _ in range(n)]

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    more = SamplingParams(temperature=0.0, max_tokens=2 + a.tokens, ignore_eos=True)
    ttft: dict[str, list[float]] = {k: [] for k in kernels}
    step: dict[str, list[float]] = {k: [] for k in kernels}
    for name, kernel in kernels.items():  # warm-up
        set_kernel(llm, kernel)
        llm.generate(prompts(a.streams, 16), one, use_tqdm=False)
    for _ in range(a.rounds):
        for name, kernel in kernels.items():
            set_kernel(llm, kernel)
            t = time.perf_counter()
            llm.generate(prompts(1, a.prompt), one, use_tqdm=False)
            ttft[name].append(time.perf_counter() - t)
            step[name].append(decode_step(llm, prompts(a.streams, 16), more))
    print(f"{a.model}: {a.prompt}-token prompt, {a.streams} streams x {a.tokens} tokens, "
          f"{a.rounds} rounds")
    for name in kernels:
        s = statistics.median(step[name])
        print(f"{name:34s} prompt {1e3 * statistics.median(ttft[name]):7.0f} ms "
              f"({', '.join(f'{1e3 * x:.0f}' for x in ttft[name])}); {a.streams}-stream step "
              f"{1e3 * s:6.0f} ms = {a.streams / s:6.2f} tok/s "
              f"({', '.join(f'{1e3 * x:.0f}' for x in step[name])})")


if __name__ == "__main__":
    main()
