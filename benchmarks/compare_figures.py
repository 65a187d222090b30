"""Figures compare.py derives beside the measured ones: the machine's memory read bandwidth, the
weight bytes an engine reads per output token, and the issues' goals checked against the peers.

A one-stream decode reads every weight once per token (all but the token-embedding table, of
which it reads one row, unless the output head is that table), so tok/s x weight bytes is the
read bandwidth it sustains: set against the machine's, it says how near the memory bound it is.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

# GGUF metadata value types: fixed sizes (8: string, 9: array)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5,
                   threads: int | None = None) -> float:
    """Bytes/s of a sum over a `size_bytes` float32 array (torch, `threads` threads, default one a
    core): the best of `repeats`, after a first pass that faults the pages in."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        x = torch.ones(size_bytes // 4, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        del x
    finally:
        torch.set_num_threads(saved)
    return size_bytes / best


def _gguf_tensors(path: Path) -> list[tuple[str, int, int]]:
    """(name, element count, ggml type) of every tensor in a GGUF file, from its header (fast
    even over a 262k-token vocabulary, which the `gguf` package's reader takes minutes on)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        pos = 24

        def string(p: int) -> int:
            (n,) = struct.unpack_from("<Q", m, p)
            return p + 8 + n

        def value(p: int, vtype: int) -> int:
            if vtype == 8:
                return string(p)
            if vtype == 9:
                item, count = struct.unpack_from("<IQ", m, p)
                p += 12
                if item in _GGUF_SIZES:
                    return p + count * _GGUF_SIZES[item]
                for _ in range(count):
                    p = value(p, item)
                return p
            return p + _GGUF_SIZES[vtype]

        for _ in range(n_kv):
            pos = string(pos)
            (vtype,) = struct.unpack_from("<I", m, pos)
            pos = value(pos + 4, vtype)
        out = []
        for _ in range(n_tensors):
            end = string(pos)
            name = m[pos + 8:end].decode()
            (n_dims,) = struct.unpack_from("<I", m, end)
            dims = struct.unpack_from(f"<{n_dims}Q", m, end + 4)
            (ggml_type,) = struct.unpack_from("<I", m, end + 4 + 8 * n_dims)
            pos = end + 4 + 8 * n_dims + 4 + 8
            count = 1
            for d in dims:
                count *= d
            out.append((name, count, ggml_type))
        return out


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the weights a one-token decode reads from this GGUF's tensors."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = _gguf_tensors(path)
    tied = not any(name == "output.weight" for name, _, _ in tensors)
    total = 0
    for name, count, ggml_type in tensors:
        if name == "token_embd.weight" and not tied:
            continue  # one row a token
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        total += count // block * size
    return total


def hf_weight_bytes(folder: Path) -> int:
    """Likewise for a Hugging Face folder of safetensors."""
    sizes: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
    untied = any(name.endswith("lm_head.weight") for name in sizes)
    return sum(v for k, v in sizes.items() if not (untied and k.endswith("embed_tokens.weight")))


def weight_bytes(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    try:
        return hf_weight_bytes(path) if path.is_dir() else gguf_weight_bytes(path)
    except (OSError, ValueError, KeyError, struct.error) as e:
        print(f"cannot count the weight bytes of {path}: {e}", flush=True)
        return None


# The goals of `loom serve MODEL` with no flags, as the issues state them (32: the default model
# and SmolLM2-1.7B's shape; 26: Gemma 3 270M): (what, figure key, concurrency or None, against
# "best" (the best peer of the run for that figure), a peer's name or None (an absolute bound),
# comparison, bound).
GOALS: dict[str, list[tuple[str, str, int | None, str | None, str, float]]] = {
    "135m": [
        ("one stream, output tokens/s", "output_throughput", 1, "best", ">=", 1.2),
        ("32 streams, output tokens/s", "output_throughput", 32, "best", ">=", 2.0),
        ("TTFT p50, one stream", "median_ttft_ms", 1, "best", "<=", 0.5),
        ("start-up until /health (s)", "health_s", None, None, "<", 3.0),
        ("peak RSS", "peak_rss_bytes", None, "llama.cpp", "<=", 1.1),
    ],
    "1.7b": [
        ("one stream, output tokens/s", "output_throughput", 1, "best", ">=", 1.3),
        ("16 streams, output tokens/s", "output_throughput", 16, "best", ">=", 2.0),
        ("peak RSS", "peak_rss_bytes", None, "llama.cpp", "<=", 1.1),
        ("one stream, share of the read bandwidth (aim)", "bandwidth_share", None, None, ">=",
         0.8),
    ],
    # the 1.7B's goals carried to the 8B body (issue 32's "1-8 B"), its 8 streams unset
    "8b": [
        ("one stream, output tokens/s", "output_throughput", 1, "best", ">=", 1.3),
        ("peak RSS", "peak_rss_bytes", None, "llama.cpp", "<=", 1.1),
        ("one stream, share of the read bandwidth (aim)", "bandwidth_share", None, None, ">=",
         0.8),
    ],
    "gemma": [
        ("one stream, output tokens/s", "output_throughput", 1, "llama.cpp", ">=", 1.5),
    ],
}
HIGHER_BETTER = {"output_throughput", "bandwidth_share"}


def figure(s: dict[str, Any], key: str, conc: int | None) -> float | None:
    if conc is None:
        return s.get(key)
    lv = next((x for x in s.get("levels", []) if x["concurrency"] == conc), None)
    return lv["median"].get(key) if lv else None


def _show(key: str, v: float) -> str:
    if key.endswith("_bytes"):
        return f"{v / 2**20:.0f} MiB"
    if key == "bandwidth_share":
        return f"{100 * v:.0f}%"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def goal_lines(summary: dict[str, dict[str, Any]], goals: str) -> list[str]:
    """One bullet per goal: Loom's figure, the peer's it is held against, the ratio, met or not."""
    lines = []
    loom = summary.get("Loom") or {}
    peers = {n: s for n, s in summary.items() if n != "Loom" and s}
    for what, key, conc, against, op, bound in GOALS.get(goals, []):
        mine = figure(loom, key, conc)
        if against is None:
            target, ref, ratio = f"{op} {bound:g}", None, mine
        else:
            vals = {n: figure(s, key, conc) for n, s in peers.items()}
            vals = {n: v for n, v in vals.items() if v}
            if against != "best":
                vals = {n: v for n, v in vals.items() if n == against}
            pick = max if key in HIGHER_BETTER else min
            ref = pick(vals, key=vals.__getitem__) if vals else None
            ratio = mine / vals[ref] if mine is not None and ref else None
            who = "the best peer" if against == "best" else against
            target = f"{op} {bound:g}x {who}"
        if mine is None or ratio is None:
            lines.append(f"- {what}, {target}: not measured")
            continue
        met = {">=": ratio >= bound, "<=": ratio <= bound, "<": ratio < bound}[op]
        vs = (f" against {ref}'s {_show(key, figure(peers[ref], key, conc))}, {ratio:.2f}x"
              if ref else "")
        lines.append(f"- {what}, {target}: Loom {_show(key, mine)}{vs}: "
                     f"**{'met' if met else 'not met'}**")
    return lines
