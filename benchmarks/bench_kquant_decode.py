"""One-stream decode of a GGUF model with Loom's defaults against `--quantization none` (the fp32
expansion K-quant files got by default before), one process, interleaved rounds, medians.

    .venv/bin/python benchmarks/bench_kquant_decode.py MODEL.gguf [--tokens 64 --rounds 5]
        [--layer-by-layer] [--no-fp32]

--layer-by-layer adds the defaults with the one-call C decoder stack turned off (each layer's
kernels called from Python, as K-quant models ran before the stack took them).
"""

from __future__ import annotations

import argparse
import statistics
import time

from loom.engine.llm import LLM
from loom.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layer-by-layer", action="store_true")
    p.add_argument("--no-fp32", action="store_true")
    a = p.parse_args()
    engines = {"default": LLM(a.model)}
    if a.layer_by_layer:
        engines["default, layer by layer"] = LLM(a.model)
        engines["default, layer by layer"].engine.runner.model.model.stack = False
    if not a.no_fp32:
        engines["fp32 (--quantization none)"] = LLM(a.model, quantization="none")
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for name, llm in engines.items():  # warm-up
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    for _ in range(a.rounds):
        for name, llm in engines.items():
            t = time.perf_counter()
            out = llm.generate([prompt], params)
            n = len(out[0].outputs[0].token_ids)
            rates[name].append(n / (time.perf_counter() - t))
    stack = engines["default"].engine.runner.model.model.stack
    print(f"default runs on the one-call C stack: {bool(stack)}")
    for name, r in rates.items():
        print(f"{name:28s} {statistics.median(r):7.1f} tok/s (median of {a.rounds}; "
              f"{', '.join(f'{x:.1f}' for x in r)})")


if __name__ == "__main__":
    main()
