"""The K-quant decode kernel's activation digits on every projection kind of a real model.

    .venv/bin/python benchmarks/bench_kquant_digits.py [--configs "all;qkv_proj;o_proj"]

Gemma 3 270M (the packaged Q4_K_M GGUF, loaded as the fp32 reference) with every linear — qkv,
o, gate_up, down and the head — re-quantized to Q4_K (even layers) or Q6_K (odd layers and the
head) by tests/kquant_quantize.py. Its widths are not multiples of 256, so x and the weights are
padded with zeros to the next one (a zero run adds exactly 0 in the kernel). Reference: the
same model with those blocks dequantized into fp32 linears, so only the kernel's quantization of
x differs. Teacher-forced top-1 agreement over tests/model/test_engine.py's 16 chats and 24
greedy tokens of the reference (tests/model/test_kquant.py's bar and helpers), the prompts and
the decode on linear_kquant.c's integer kernel: two digits a run of 16 (the default), then one
digit (LOOM_KQ_ONE_DIGIT) on the projections each config names ("all": every one).

`--int16-groups 256,row`: also x rounded to ONE int16 a group of that many values (one scale
each, d = max|x| / 32767; "row": the whole padded row) on every projection, multiplied in fp32
by the same dequantized blocks: the activations an integer GEMM past 8 rows would take if it
summed a whole super-block (the weights' 6-bit sub-block scales applied as integers) in int32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from loom.kernels import cpu_kernels
from loom.loader.model_loader import load_model
from loom.loader.resolve import resolve_model
from loom.tokenizer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.gguf_files import gemma3_gguf_path  # noqa: E402
from tests.kquant_quantize import QUANTIZERS  # noqa: E402
from tests.model.test_engine import chats  # noqa: E402
from tests.model.test_kquant import reference_continuations, teacher_forced_top1  # noqa: E402

ONE_DIGIT = 0x100  # loom.h's LOOM_KQ_ONE_DIGIT
STEPS = 24
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")  # what --configs names


class PaddedKQ(torch.nn.Module):
    """A linear on K-quant blocks of its weight padded to K' (a multiple of 256) columns."""

    def __init__(self, kind: str, blocks: np.ndarray, qtype: T, k: int, n: int) -> None:
        super().__init__()
        self.kind, self.k, self.n = kind, k, n
        self.blocks, self.fmt = torch.from_numpy(blocks), {T.Q4_K: 12, T.Q6_K: 14}[qtype]
        self.kp = -(-k // 256) * 256
        self.one = False
        self.int16_group = 0  # > 0: x on one int16 a group of that many, times `weight`
        self.weight: torch.Tensor | None = None  # the blocks dequantized [n, k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.k)
        xp = torch.zeros((rows.shape[0], self.kp))  # [num_tokens, K']
        xp[:, :self.k] = rows
        if self.int16_group:
            g = xp.reshape(rows.shape[0], -1, self.int16_group)
            d = g.abs().amax(-1, keepdim=True) / 32767.0
            xr = (torch.round(g / torch.where(d > 0, d, 1.0)) * d).reshape(xp.shape)
            return (xr[:, :self.k] @ self.weight.T).reshape(*x.shape[:-1], self.n)
        y = torch.empty((rows.shape[0], self.n))
        rc = cpu_kernels().loom_linear_kq(
            xp.data_ptr(), rows.shape[0], self.kp, self.kp, self.blocks.data_ptr(),
            self.fmt | (ONE_DIGIT if self.one else 0), None, self.n, y.data_ptr(), self.n,
            torch.get_num_threads())
        assert rc == 0, rc
        return y.reshape(*x.shape[:-1], self.n)


def requantize(ref_parent: torch.nn.Module, kq_parent: torch.nn.Module, name: str,
               qtype: T) -> PaddedKQ:
    """ref_parent.name's weight -> its blocks' dequantized values; kq_parent.name -> the
    blocks on the kernel."""
    linear = getattr(ref_parent, name)
    w = linear.weight.detach().numpy()
    n, k = w.shape
    padded = np.zeros((n, -(-k // 256) * 256), np.float32)
    padded[:, :k] = w
    blocks = QUANTIZERS[qtype](padded)
    back = dequantize(blocks.reshape(-1), qtype).reshape(padded.shape)[:, :k]
    linear.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(back)),
                                       requires_grad=False)
    module = PaddedKQ(name, blocks, qtype, k, n)
    module.weight = linear.weight.detach()
    setattr(kq_parent, name, module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=";".join(("all", *KINDS)),
                   help="';'-separated sets of ','-separated projections on one digit")
    p.add_argument("--int16-groups", default="",
                   help="comma-separated group sizes (multiples of 256, or row) for x on one int16")
    a = p.parse_args()
    named = {k for c in filter(None, a.configs.split(";")) for k in c.split(",")}
    unknown = named - {"all", *KINDS}
    if unknown:  # (it would run as two digits, labelled one)
        p.error(f"unknown projections {sorted(unknown)}; choose from all, {', '.join(KINDS)}")
    t0 = time.perf_counter()
    source = resolve_model(str(gemma3_gguf_path()))
    ref = load_model(source, "float32", quantization="none")
    kq = load_model(source, "float32", quantization="none")
    ref.model.lm_head.weight = torch.nn.Parameter(  # untied: the head gets its own blocks
        ref.model.lm_head.weight.detach().clone(), requires_grad=False)
    modules = []
    for i, (lr, lk) in enumerate(zip(ref.model.model.layers, kq.model.model.layers)):
        qtype = T.Q4_K if i % 2 == 0 else T.Q6_K
        for parent_r, parent_k, names in ((lr.self_attn, lk.self_attn, ("qkv_proj", "o_proj")),
                                          (lr.mlp, lk.mlp, ("gate_up_proj", "down_proj"))):
            modules += [requantize(parent_r, parent_k, n, qtype) for n in names]
    modules.append(requantize(ref.model, kq.model, "lm_head", T.Q6_K))
    print(f"re-quantized {len(modules)} linears in {time.perf_counter() - t0:.0f} s")

    tok = Tokenizer.from_source(source, ref.config.eos_token_ids)
    prompts = {str(i): tok.encode_chat(c) for i, c in enumerate(chats())}
    want, seqs = reference_continuations(ref, prompts, STEPS)
    total = sum(len(v) for v in want.values())

    configs = ["two digits everywhere", *filter(None, a.configs.split(";"))]
    configs += [f"int16:{g}" for g in filter(None, a.int16_groups.split(","))]
    for config in configs:
        kinds = set(config.split(","))
        group = config.removeprefix("int16:") if config.startswith("int16:") else "0"
        for m in modules:
            m.one = "all" in kinds or m.kind in kinds
            m.int16_group = m.kp if group == "row" else int(group)
        got = teacher_forced_top1(kq, prompts, seqs, STEPS)
        agree = sum(int((got[k] == want[k]).sum()) for k in want)
        label = (config if config.startswith("two") else
                 f"one int16 a group of {config[6:]}, all" if config.startswith("int16:") else
                 f"one digit on {config}")
        print(f"{label:40s} top-1 {agree} / {total} ({agree / total:.2%})", flush=True)


if __name__ == "__main__":
    main()
