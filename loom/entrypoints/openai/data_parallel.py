"""`loom serve --data-parallel-size N`: N engine replicas and the router in one command.

Each replica is a full `loom serve` (its own engine, KV cache and prefix cache) in a spawned
process on an internal loopback port; once every one answers /health, the router
(loom/router) serves on --host/--port in front of them. Stopping the command (SIGTERM/SIGINT)
stops the router, then each replica with its own graceful drain.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import replace
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import httpx

from loom.loader.hugepages import ENV as HUGE_PAGES_ENV
from loom.net import free_port
from loom.threads import default_num_threads

if TYPE_CHECKING:
    from loom.engine.args import EngineArgs
    from loom.entrypoints.openai.server_args import ServerArgs

logger = logging.getLogger(__name__)


def _replica_main(index: int, engine_args: EngineArgs, server_args: ServerArgs,
                  parent: int) -> None:
    """A replica process: `loom serve` on its internal port, its log lines tagged; it stops
    (gracefully) if the command's process dies without stopping it."""
    from loom.entrypoints.openai.api_server import run_server

    logging.basicConfig(level=logging.INFO,
                        format=f"%(levelname)s [replica {index}] %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # The replicas share the GGUF file's pages (one copy in memory for all): each its own
    # anonymous copy on huge pages would take N times the memory (loom/loader/hugepages.py)
    os.environ.setdefault(HUGE_PAGES_ENV, "tensors")
    run_server(engine_args, server_args)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    logger.warning("the launching process is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)


def _wait_ready(procs: list[BaseProcess], urls: list[str]) -> None:
    """Block until every replica answers /health 200; SystemExit if one exits first."""
    pending = set(range(len(urls)))
    while pending:
        for i in sorted(pending):
            if not procs[i].is_alive():
                raise SystemExit(f"error: replica {i} exited with code {procs[i].exitcode} "
                                 "before it was ready (its log is above)")
            try:
                if httpx.get(f"{urls[i]}/health", timeout=2).status_code == 200:
                    pending.discard(i)
                    logger.info("replica %d ready at %s", i, urls[i])
            except httpx.HTTPError:
                pass
        time.sleep(0.25)


def _stop(procs: list[BaseProcess], grace: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()  # SIGTERM: the replica drains its running requests
    deadline = time.monotonic() + grace + 10
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_data_parallel(engine_args: EngineArgs, args: ServerArgs) -> None:
    from loom.router.app import run_router
    from loom.router.args import RouterArgs

    logging.getLogger().setLevel(args.log_level.upper())
    n = args.data_parallel_size
    if engine_args.num_threads is None:  # the replicas share the cores
        engine_args = replace(engine_args, num_threads=max(1, default_num_threads()[0] // n))
    internal = "127.0.0.1"
    ports = [free_port(internal) for _ in range(n)]
    urls = [f"http://{internal}:{p}" for p in ports]
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    try:
        for i, port in enumerate(ports):
            replica_args = replace(args, host=internal, port=port, data_parallel_size=1)
            p = ctx.Process(target=_replica_main, name=f"loom-replica-{i}",
                            args=(i, engine_args, replica_args, os.getpid()))
            p.start()
            procs.append(p)
        logger.info("data parallel: %d replicas at %s (%d threads each)", n, ", ".join(urls),
                    engine_args.num_threads)
        _wait_ready(procs, urls)
        run_router(RouterArgs(backends=tuple(urls), host=args.host, port=args.port,
                              log_level=args.log_level))
    finally:
        _stop(procs, args.timeout_graceful_shutdown)
