"""`loom bench serve | sweep | throughput | startup`.

Exit codes: 0 when every request succeeded; 1 when some failed (the results, partial, are still
printed and written); 2 for bad input (flags, dataset file, unreachable server).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loom.bench import ENDPOINTS
from loom.engine.arg_utils import (
    add_dataclass_args,
    from_namespace,
    positive_float,
    positive_int,
)
from loom.engine.args import EngineArgs

# The bench modules (httpx, numpy, rich) are imported by the commands that use them, not here:
# every `loom` command builds this parser, and `loom serve` should not pay for them at start-up.
if TYPE_CHECKING:
    from loom.bench.runner import BenchConfig


def _fail(msg: str) -> SystemExit:
    print(f"loom bench: error: {msg}", file=sys.stderr)
    return SystemExit(2)


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str | None) -> Any:
    """The bench tokenizer: a .gguf, an HF folder or cached repo id; None = packaged SmolLM2."""
    from loom.loader.resolve import ModelNotFoundError, resolve_model
    from loom.tokenizer.tokenizer import Tokenizer

    try:
        return Tokenizer.from_source(resolve_model(name))
    except (ModelNotFoundError, OSError, ValueError) as e:
        raise _fail(f"cannot load the tokenizer {name or '(default model)'}: {e}") from None


def make_prompt_source(ns: argparse.Namespace, tokenizer: Any):
    """(num_prompts, seed) -> prompts, from --dataset or the synthetic generator."""
    from loom.bench.datasets import BenchPrompt, load_jsonl, normal_token_ids, synthetic_prompts

    vocab = None if ns.dataset else normal_token_ids(tokenizer)

    def source(num_prompts: int, seed: int) -> list[BenchPrompt]:
        if ns.dataset:
            return load_jsonl(ns.dataset, tokenizer, num_prompts, ns.output_len)
        return synthetic_prompts(tokenizer, num_prompts, ns.input_len, ns.output_len, seed, vocab)

    return source


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model name sent in requests (default: the first of /v1/models)")
    p.add_argument("--endpoint", default="completions", choices=sorted(ENDPOINTS))
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=128, help="max_tokens per request")
    p.add_argument("--dataset", default=None,
                   help='JSONL file, one {"prompt": text, "output_len": n (optional)} per line')
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and arrivals")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for prompts and counting (.gguf, HF folder; default: SmolLM2)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server for exactly --output-len tokens (default: on)")
    p.add_argument("--stream-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for token usage in the stream (stream_options.include_usage)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="seconds any single wait on the server may take")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _check_dataset(ns: argparse.Namespace) -> None:
    if ns.dataset and not Path(ns.dataset).is_file():
        raise _fail(f"dataset file not found: {ns.dataset}")


def _config(ns: argparse.Namespace, base_url: str, model: str | None) -> BenchConfig:
    from loom.bench.runner import BenchConfig, check_reachable, server_model

    if model is None:
        model = server_model(base_url)
    else:
        check_reachable(base_url)
    return BenchConfig(base_url=base_url, model=model, endpoint=ns.endpoint,
                       ignore_eos=ns.ignore_eos, stream_usage=ns.stream_usage, seed=ns.seed,
                       request_timeout=ns.request_timeout, disable_tqdm=ns.disable_tqdm)


def _write_json(path: str | None, obj: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n")
        print(f"results written to {path}")


def cmd_serve(ns: argparse.Namespace) -> int:
    from loom.bench.datasets import DatasetError
    from loom.bench.metrics import SLOError, compute_metrics, format_report, notes, parse_goodput
    from loom.bench.request import RequestInput
    from loom.bench.runner import BenchError, run_benchmark

    _check_dataset(ns)
    try:
        goodput = parse_goodput(ns.goodput)
        cfg = _config(ns, ns.base_url, ns.model)
        tokenizer = load_tokenizer(ns.tokenizer)
        prompts = make_prompt_source(ns, tokenizer)(ns.num_prompts, ns.seed)
    except (BenchError, DatasetError, SLOError) as e:
        raise _fail(str(e)) from None
    cfg = replace(cfg, concurrency=ns.concurrency, request_rate=ns.request_rate)
    inputs = [RequestInput(i, p.prompt, p.prompt_len, p.output_len) for i, p in enumerate(prompts)]
    print(f"{cfg.model} at {cfg.base_url}: {len(inputs)} requests, concurrency "
          f"{cfg.concurrency or 'unbounded'}, rate {cfg.request_rate} req/s")
    res = run_benchmark(cfg, inputs, tokenizer)
    m = compute_metrics(res.records, res.duration, goodput or None)
    print(format_report(m))
    for line in notes(m, cfg.ignore_eos):
        print(line)
    config = {k: v for k, v in cfg.__dict__.items() if k != "request_rate"}
    config["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate
    _write_json(ns.result_json, {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config,
        "input_len": ns.input_len, "output_len": ns.output_len, "dataset": ns.dataset,
        "goodput_slos_ms": goodput, **m, "records": [r.to_dict() for r in res.records],
    })
    return 1 if m["failed"] else 0


def cmd_sweep(ns: argparse.Namespace) -> int:
    from loom.bench.sweep import (
        SweepPlan,
        parse_concurrencies,
        parse_servers,
        plot_sweep,
        sweep_server,
    )
    from loom.bench.datasets import DatasetError
    from loom.bench.metrics import SLOError, parse_goodput
    from loom.bench.runner import BenchError

    _check_dataset(ns)
    try:
        servers = parse_servers(ns.server)
        plan = SweepPlan(parse_concurrencies(ns.concurrency), ns.repeats, ns.prompts_per_level,
                         ns.min_prompts, ns.seed)
        goodput = parse_goodput(ns.goodput)
        configs = {name: _config(ns, url, ns.model) for name, url in servers.items()}
        tokenizer = load_tokenizer(ns.tokenizer)
        source = make_prompt_source(ns, tokenizer)
    except (BenchError, DatasetError, SLOError, ValueError) as e:
        raise _fail(str(e)) from None
    results = {}
    for name, cfg in configs.items():
        print(f"== {name}: {cfg.model} at {cfg.base_url}")
        results[name] = sweep_server(cfg, plan, source, tokenizer, goodput or None)
    _write_json(ns.result_json, {"date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                 "plan": plan.__dict__, "input_len": ns.input_len,
                                 "output_len": ns.output_len, "servers": results})
    if ns.plot:
        plot_sweep(results, ns.plot, f"{ns.input_len}-token prompts, {ns.output_len} output tokens")
        print(f"plot written to {ns.plot}")
    failed = sum(run["failed"] for r in results.values() for lv in r["levels"]
                 for run in lv["runs"])
    return 1 if failed else 0


def cmd_throughput(ns: argparse.Namespace) -> int:
    from loom.bench.datasets import DatasetError
    from loom.bench.offline import format_throughput, run_throughput
    from loom.engine.llm import LLM

    _check_dataset(ns)
    t0 = time.perf_counter()
    try:
        llm = LLM(**asdict(from_namespace(EngineArgs, ns)))
    except (OSError, ValueError) as e:
        raise _fail(f"cannot load the model {ns.model or '(default)'}: {e}") from None
    load_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    try:
        prompts = make_prompt_source(ns, tokenizer)(ns.num_prompts, ns.seed)
    except DatasetError as e:
        raise _fail(str(e)) from None
    m = run_throughput(prompts, llm, ns.ignore_eos, use_tqdm=not ns.disable_tqdm)
    print(f"model loaded in {load_s:.2f} s")
    print(format_throughput(m))
    _write_json(ns.result_json, {"model": ns.model, "input_len": ns.input_len,
                                 "output_len": ns.output_len, "load_time": load_s, **m})
    return 0


def cmd_startup(ns: argparse.Namespace) -> int:
    from loom.bench.runner import BenchError, server_model
    from loom.bench.server_proc import ServerProcess, ServerStartError

    cmd = ns.server_command[1:] if ns.server_command[:1] == ["--"] else ns.server_command
    if not cmd:
        raise _fail("give the server command after --, e.g. "
                    "loom bench startup --base-url http://127.0.0.1:8000 -- loom serve --port 8000")
    runs = []
    for i in range(ns.repeats):
        server = ServerProcess(cmd, ns.base_url, log_path=ns.log)
        try:
            with server:
                health = server.wait_healthy(ns.timeout)
                model = ns.model or server_model(ns.base_url)
                first = server.first_token(model, ns.timeout)
        except (ServerStartError, BenchError) as e:
            raise _fail(str(e)) from None
        runs.append({"health_s": health, "first_token_s": first,
                     "peak_rss_bytes": server.peak_rss, "peak_pss_bytes": server.peak_pss})
        print(f"run {i + 1}: /health after {health:.2f} s, first token after {first:.2f} s, "
              f"peak RSS {server.peak_rss / 2**20:.0f} MiB")
    _write_json(ns.result_json, {"command": cmd, "runs": runs})
    return 0


def register(sub: Any) -> None:
    """Register `loom bench` and its subcommands on the top-level subparsers."""
    bench = sub.add_parser("bench", help="benchmark a server (any OpenAI-compatible) or the engine")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = bsub.add_parser("serve", help="streamed load against one server, vLLM bench serve figures")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    _add_load_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=100)
    p.add_argument("--concurrency", "--max-concurrency", type=positive_int, default=None,
                   help="most requests in flight (default: unbounded)")
    p.add_argument("--request-rate", type=positive_float, default=math.inf,
                   help="requests/s with Poisson arrivals (default: inf, all at once)")
    p.add_argument("--result-json", default=None, help="write figures and per-request records")
    p.set_defaults(func=_run(cmd_serve))

    p = bsub.add_parser("sweep", help="several concurrencies x several servers -> JSON + PNG")
    p.add_argument("--server", action="append", required=True, metavar="NAME=URL",
                   help="a server to measure (repeatable)")
    _add_load_args(p)
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    p.add_argument("--repeats", type=positive_int, default=1, help="runs per level (median)")
    p.add_argument("--prompts-per-level", type=positive_int, default=1,
                   help="requests per level = max(this x concurrency, --min-prompts)")
    p.add_argument("--min-prompts", type=positive_int, default=4)
    p.add_argument("--result-json", default="sweep.json")
    p.add_argument("--plot", default="sweep.png", help="PNG path ('' for none)")
    p.set_defaults(func=_run(cmd_sweep))

    p = bsub.add_parser("throughput", help="offline LLM.generate throughput")
    add_dataclass_args(p, EngineArgs, skip=("served_model_name",))
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--dataset", default=None)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--result-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_run(cmd_throughput))

    p = bsub.add_parser("startup", help="time a server command until /health and a first token")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="where the server listens")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--timeout", type=positive_float, default=300.0)
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument("--log", default=None, help="file for the server's output")
    p.add_argument("--result-json", default=None)
    p.add_argument("server_command", nargs=argparse.REMAINDER, help="-- the server command")
    p.set_defaults(func=_run(cmd_startup))


def _run(fn):
    def run(ns: argparse.Namespace) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
        code = fn(ns)
        if code:
            raise SystemExit(code)

    return run
