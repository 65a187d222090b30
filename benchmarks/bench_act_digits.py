"""What int8 activations would cost in accuracy: the default model's teacher-forced top-1
agreement with the fp32 reference when the input of some linears is rounded to ONE int8 digit a
group (d = max|x| / 127, x ~ d round(x / d): llama.cpp's Q8 activations, what a `vpdpbusd`
kernel at 64 products an instruction would take), the rest exact.

    .venv/bin/python benchmarks/bench_act_digits.py [--group 32] [--only qkv,gate_up]

The weights are the default model's (Q4_1 on the int8 grid) on the fp32 kernel
(batch-invariant), the module path; the rounding is applied in torch before each chosen linear,
so the figure is the activations' precision alone (not a kernel's). The positions are
tests/model/test_quant.py's: 16 chats and the reference's 48-token greedy continuations (1495),
fed in one step. Loom's bar for a default kernel is 99%.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from loom.loader.model_loader import load_model
from loom.quant.int8 import Int8Linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.model.test_quant import _agreement, teacher_forced  # noqa: E402
from tests.paged_batch import PagedBatch  # noqa: E402

# (label, linears whose input is rounded: a substring of their module name, "" all)
SETS = [("none", None), ("all", ""), ("qkv_proj", "qkv_proj"), ("o_proj", "o_proj"),
        ("gate_up_proj", "gate_up_proj"), ("down_proj", "down_proj"), ("lm_head", "lm_head")]


def one_digit(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded to one int8 digit a group of `group` values along the last dimension."""
    g = x.float().reshape(*x.shape[:-1], -1, group)  # [..., K / group, group]
    d = g.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return (torch.round(g / safe) * d).reshape(x.shape).to(x.dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--only", default="", help="comma-separated labels of SETS (default: all)")
    a = p.parse_args()
    only = set(filter(None, a.only.split(",")))
    unknown = only - {label for label, _ in SETS}
    if unknown:  # (it would print nothing for them)
        p.error(f"unknown labels {sorted(unknown)}")
    source, seqs, ref, _ = teacher_forced.__wrapped__()
    model = load_model(source, "float32", quantization="int8", batch_invariant=True)
    model.model.model.stack = False  # the module path: each linear's forward runs
    linears = {n: m for n, m in model.model.named_modules() if isinstance(m, Int8Linear)}
    rounded: set[int] = set()
    forward = Int8Linear.forward

    def rounding_forward(self: Int8Linear, x: torch.Tensor) -> torch.Tensor:
        return forward(self, one_digit(x, a.group) if id(self) in rounded else x)

    Int8Linear.forward = rounding_forward  # type: ignore[method-assign]
    total = sum(len(s) for s in seqs.values())
    print(f"one int8 digit a group of {a.group}, {total} positions, teacher-forced")
    for label, pattern in SETS:
        if only and label not in only:
            continue
        rounded.clear()
        if pattern is not None:
            rounded.update(id(m) for n, m in linears.items() if pattern in n)
        agree, err = _agreement(PagedBatch(model, num_blocks=256).step(seqs), ref, seqs)
        print(f"  {label:13s} {len(rounded):3d} linears  top-1 {round(agree * total):4d} / "
              f"{total} ({agree:.4f})  logit error {err:.4f}", flush=True)


if __name__ == "__main__":
    main()
