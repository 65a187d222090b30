"""Two builds of Loom's C kernels in one process: one `LLM`, the library the decoder stack calls
swapped between this checkout's build (the one `auto` or LOOM_CPU_KERNELS selects) and another
build of the same kernels (`OTHER.so`) before every generate, in alternating order; per round
the median decode step of each and the time of the prompts' steps, and the ratios. On a shared
VM whose memory speed moves from minute to minute, separate processes disagree by more than most kernel changes do: this is the
A/B that says something about a step (benchmarks/bench_kquant_ab.py is the one for a kernel).

    .venv/bin/python benchmarks/bench_kernel_ab.py OTHER.so [--model MODEL.gguf]
        [--streams 1,4] [--rounds 6] [--tokens 48]

OTHER.so: e.g. the variant's library from ~/.cache/loom/kernels copied aside before a change to
loom/kernels/csrc (the same exported functions and structs: a build of another ABI crashes).
Prints, per stream count, both medians and the median of the per-round ratios (this build /
OTHER), for decode steps and for the prompts' steps (every step of more rows than streams; each
build's prompts its own, so neither meets the other's prefix cache). Only what the one-call
decoder stack runs is compared (the Python around it is the same).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import loom.kernels as kernels
import loom.models.q8_decoder as q8_decoder
from loom.engine.llm import LLM
from loom.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("other", help="another build of the kernels (.so)")
    p.add_argument("--model", default=None, help="GGUF file (default: Loom's default model)")
    p.add_argument("--streams", default="1,4", help="comma-separated stream counts")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48, help="output tokens a stream a round")
    a = p.parse_args()
    if a.tokens < 2:
        p.error("--tokens must be at least 2 (the first comes from the prompt's step)")
    streams = [int(s) for s in a.streams.split(",")]
    llm = LLM(a.model) if a.model else LLM()
    this, choice = kernels._current[0]  # the selection LLM made (private: a benchmark's view)
    other = kernels._load(Path(a.other))
    steps: list[tuple[int, float]] = []
    forward = q8_decoder.Q8Decoder.forward

    def timed(self, *args, **kw):
        t = time.perf_counter()
        out = forward(self, *args, **kw)
        steps.append((args[0].shape[0], time.perf_counter() - t))
        return out

    q8_decoder.Q8Decoder.forward = timed
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    med: dict[tuple[int, str], list[float]] = {}
    order = [("this", this), ("other", other)]
    for rnd in range(a.rounds):
        for n in streams:
            for name, lib in order if rnd % 2 == 0 else order[::-1]:
                kernels._current[:] = [(lib, choice)]
                steps.clear()
                llm.generate([f"{rnd} {name} {i} {PROMPT}" for i in range(n)], params,
                             use_tqdm=False)
                med.setdefault((n, name), []).append(
                    statistics.median(t for m, t in steps if m == n))  # decode steps
                med.setdefault((n, name + " prompt"), []).append(sum(t for m, t in steps if m > n))
    kernels._current[:] = [(this, choice)]
    model = Path(a.model).name if a.model else "default model"
    for n in streams:
        for what, key in (("a decode step", ""), ("the prompts' steps", " prompt")):
            t, o = med[(n, "this" + key)], med[(n, "other" + key)]
            ratios = [x / y for x, y in zip(t, o)]
            print(f"{model}, {n} stream(s): this build {1e3 * statistics.median(t):.2f} ms, other "
                  f"{1e3 * statistics.median(o):.2f} ms {what}; this / other per round "
                  + " ".join(f"{r:.3f}" for r in ratios)
                  + f", median {statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
