"""What structured output costs: output tokens/s with `response_format: json_schema` vs
unconstrained, at 1 and 16 concurrent streams, against one `loom serve` of the default model;
plus the time to compile a schema (cold and cached).

Both modes produce exactly `--max-tokens` tokens per request (unconstrained: ignore_eos; the
schema asks for more items than fit), so the ratio compares the same work. Modes alternate
within each round; the figure is the median over rounds.

    .venv/bin/python benchmarks/bench_structured.py --out benchmarks/results/structured-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from tqdm import tqdm

from loom.bench.server_proc import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dump, free_port, machine  # noqa: E402

# Long enough that every request runs to max_tokens inside the JSON.
SCHEMA = {"type": "object", "properties": {"cities": {"type": "array", "minItems": 40,
          "maxItems": 40, "items": {"type": "object", "properties": {
              "name": {"type": "string", "maxLength": 24},
              "population": {"type": "integer", "minimum": 0}},
              "required": ["name", "population"]}}}, "required": ["cities"]}
PROMPT = "List forty world cities with their populations as JSON."


async def one_round(client: AsyncOpenAI, streams: int, constrained: bool, max_tokens: int) -> dict:
    extra: dict[str, Any] = {}
    if constrained:
        extra["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "cities", "schema": SCHEMA}}
    else:
        extra["extra_body"] = {"ignore_eos": True}

    async def one(i: int) -> int:
        r = await client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": f"{PROMPT} (#{i})"}],
            max_tokens=max_tokens, temperature=0, **extra)
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    return {"tokens": sum(tokens), "seconds": wall, "tok_s": sum(tokens) / wall}


def compile_times() -> dict[str, float]:
    """Grammar engine set-up and per-schema compile times, in this process (ms)."""
    from bench_grammar import CASES

    from loom.loader.resolve import resolve_model
    from loom.structured.manager import StructuredOutputManager
    from loom.structured.params import StructuredOutputsParams
    from loom.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None))
    manager = StructuredOutputManager(tok, tok.vocab_size)
    t0 = time.perf_counter()
    manager.backend  # noqa: B018 - builds the llguidance tokenizer
    setup_ms = (time.perf_counter() - t0) * 1e3
    cold, warm = [], []
    for _, schema, _ in [*CASES, ("bench", SCHEMA, None)]:
        for times in (cold, warm):
            t0 = time.perf_counter()
            manager.compile(StructuredOutputsParams(json=schema))
            times.append((time.perf_counter() - t0) * 1e3)
    return {"engine_setup_ms": round(setup_ms, 1),
            "compile_ms_median": round(statistics.median(cold), 2),
            "compile_ms_max": round(max(cold), 2),
            "cached_ms_median": round(statistics.median(warm), 4)}


async def run(ns: argparse.Namespace, base_url: str) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=3600)
    await one_round(client, 1, True, 8)  # warm-up (also compiles the schema once)
    results: dict[str, Any] = {}
    total = len(ns.streams) * ns.rounds * 2
    with tqdm(total=total, desc="rounds", unit="run") as bar:
        for streams in ns.streams:
            runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
            for r in range(ns.rounds):
                order = [False, True] if r % 2 == 0 else [True, False]
                for constrained in order:
                    res = await one_round(client, streams, constrained, ns.max_tokens)
                    runs["json_schema" if constrained else "unconstrained"].append(res["tok_s"])
                    bar.update()
            plain = statistics.median(runs["unconstrained"])
            structured = statistics.median(runs["json_schema"])
            results[str(streams)] = {
                "unconstrained_tok_s": round(plain, 2), "json_schema_tok_s": round(structured, 2),
                "ratio": round(structured / plain, 3), "runs": runs,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    compile = compile_times()
    port = free_port()
    loom = Path(sys.executable).parent / "loom"
    cmd = [str(loom), "serve", "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", str(max(ns.streams)), "--disable-log-requests"]
    with ServerProcess(cmd, f"http://127.0.0.1:{port}") as server:
        server.wait_healthy()
        throughput = asyncio.run(run(ns, f"http://127.0.0.1:{port}"))
    result = {"machine": machine(), "command": " ".join(sys.argv), "compile": compile,
              "throughput": throughput, "max_tokens": ns.max_tokens, "rounds": ns.rounds}
    print(f"compile: {compile}")
    print(f"{'streams':>8} {'plain tok/s':>12} {'json tok/s':>11} {'ratio':>6}")
    for streams, r in throughput.items():
        print(f"{streams:>8} {r['unconstrained_tok_s']:12.2f} {r['json_schema_tok_s']:11.2f} "
              f"{r['ratio']:6.3f}")
    dump(str(ns.out) if ns.out else None, result)


if __name__ == "__main__":
    main()
