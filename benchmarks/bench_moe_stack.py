"""Decode of a random-weight Qwen3-MoE GGUF (quantized experts) on the one-call C stack against
layer by layer (the stack off: each layer's kernels called from Python, as mixtures of experts
ran before the stack took them), in one process, interleaved rounds, medians.

    .venv/bin/python benchmarks/bench_moe_stack.py [--hidden 1024 --experts 32 --top-k 4
        --moe-inter 512 --layers 8 --experts-type Q4_K --streams 1,8 --steps 32 --rounds 3]

The model is written to a temporary folder (tests/ helpers: transformers' config, the `gguf`
writer; K-quant experts as valid random blocks). Tokens/s of decode steps only (the prompts'
prefill is not timed); Loom's default kernels unless --batch-invariant.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from tests.model.test_moe_gguf import write_moe_gguf
from tests.paged_batch import PagedBatch
from tests.tiny_models import make_tiny_model


def write_model(folder: Path, a: argparse.Namespace) -> Path:
    shape = dict(hidden_size=a.hidden, intermediate_size=a.moe_inter,
                 moe_intermediate_size=a.moe_inter,
                 num_experts=a.experts, num_experts_per_tok=a.top_k, num_hidden_layers=a.layers,
                 num_attention_heads=a.hidden // 128, num_key_value_heads=max(1, a.hidden // 512),
                 head_dim=128, mlp_only_layers=[], vocab_size=4096)
    hf = make_tiny_model("qwen3-moe", folder / "hf", **shape)
    return write_moe_gguf(hf, folder / "moe.gguf", "qwen3moe", T.Q8_0, (T[a.experts_type],) * 3)


def decode_rate(loaded, streams: int, steps: int) -> float:
    """Tokens/s of `steps` decode steps of `streams` requests after a 16-token prompt each."""
    g = torch.Generator().manual_seed(0)
    batch = PagedBatch(loaded, num_blocks=streams * ((16 + steps) // 16 + 2) + 1)
    out = batch.step({f"r{i}": torch.randint(0, 4096, (16,), generator=g).tolist()
                      for i in range(streams)})
    t = time.perf_counter()
    for _ in range(steps):
        out = batch.step({r: [int(v[-1].argmax())] for r, v in out.items()})
    return streams * steps / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts-type", default="Q4_K", choices=["Q4_K", "Q5_K", "Q6_K", "Q4_0",
                                                              "Q8_0"])
    p.add_argument("--streams", default="1,8")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-invariant", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = resolve_model(str(write_model(Path(tmp), a)))
        stack = load_model(source, "float32", batch_invariant=a.batch_invariant)
        layers = load_model(source, "float32", batch_invariant=a.batch_invariant)
        layers.model.model.stack = False
        for n in map(int, a.streams.split(",")):
            rates: dict[str, list[float]] = {"C stack": [], "layer by layer": []}
            for loaded in (stack, layers):  # warm-up
                decode_rate(loaded, n, 2)
            for _ in range(a.rounds):
                rates["C stack"].append(decode_rate(stack, n, a.steps))
                rates["layer by layer"].append(decode_rate(layers, n, a.steps))
            assert stack.model.model.stack, "the C stack did not run"
            for name, r in rates.items():
                print(f"{n:3d} streams  {name:15s} {statistics.median(r):8.1f} tok/s (median of "
                      f"{a.rounds}; {', '.join(f'{x:.1f}' for x in r)})")


if __name__ == "__main__":
    main()
