"""Tensor-parallel ranks as processes driven by the engine.

Rank 0 is the engine's own process: one scheduler, its ModelRunner on rank 0's slices. Ranks
1..N-1 are spawned worker processes, each with a ModelRunner on its slices and a KV cache of
the same number of blocks. Each step rank 0 sends every worker the step's SchedulerOutput
(over a pipe: plain data) with the tokens rank 0 sampled last step, and all ranks execute it;
their forward passes meet in the layers' collectives (torch.distributed: gloo on the CPU,
NCCL on CUDA). Every rank gets the whole logits and samples, but only rank 0's tokens count:
a worker takes them over before its next step, so the ranks' token histories never diverge.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import socket
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loom.config import ConfigError
from loom.distributed.tensor_parallel import check_shardable, shard_model

if TYPE_CHECKING:
    from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from loom.loader.model_loader import LoadedModel
    from loom.loader.resolve import ModelSource
    from loom.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load and run its slices (picklable)."""

    source: ModelSource
    dtype: str
    device: str
    quantization: str | None
    cpu_kernels: str
    batch_invariant: bool
    seed: int | None
    num_threads: int | None
    world: int
    init_method: str


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_threads(num_threads: int | None, world: int, device: torch.device) -> int | None:
    """CPU threads per rank: as given, else the cores shared out."""
    if num_threads is not None or device.type != "cpu":
        return num_threads
    return max(1, (os.cpu_count() or 1) // world)


class TensorParallel:
    """Rank 0's side: the workers, their pipes, and the runner wrapper (`drive`)."""

    def __init__(self, loaded: LoadedModel, procs: list[BaseProcess],
                 conns: list[Connection]) -> None:
        self.loaded = loaded
        self.procs = procs
        self.conns = conns

    @classmethod
    def start(cls, args: Any, source: ModelSource, device: torch.device,
              loaded: LoadedModel) -> TensorParallel:
        """Check the model splits, start the workers, join the process group and slice rank
        0's copy. `args`: the EngineArgs."""
        from loom.threads import set_num_threads

        world = args.tensor_parallel_size
        check_shardable(loaded.model, loaded.config, world)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ConfigError(f"--tensor-parallel-size {world} needs {world} GPUs; "
                              f"torch sees {torch.cuda.device_count()}")
        threads = default_threads(args.num_threads, world, device)
        set_num_threads(threads)
        spec = WorkerSpec(source, args.dtype, device.type, args.quantization, args.cpu_kernels,
                          args.batch_invariant, args.seed, threads, world,
                          f"tcp://127.0.0.1:{_free_port()}")
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, spec, theirs), daemon=True,
                            name=f"loom-tp-rank{rank}")
            p.start()
            procs.append(p)
            conns.append(ours)
        try:
            for rank, (conn, proc) in enumerate(zip(conns, procs), start=1):
                _expect(conn, proc, rank, "started")
        except RuntimeError:
            cls(loaded, procs, conns).close()
            raise
        dist.init_process_group(_backend(device), init_method=spec.init_method, rank=0,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT)
        config = shard_model(loaded.model, loaded.config, 0, world)
        logger.info("tensor parallel: %d ranks over %s (%s threads each)", world,
                    _backend(device), threads)
        return cls(replace(loaded, config=config), procs, conns)

    def drive(self, runner: ModelRunner, num_blocks: int, kv_dtype: torch.dtype,
              eos_token_ids: tuple[int, ...], block_size: int) -> _Driver:
        """Have every worker build its runner like rank 0's; the wrapper to step them all."""
        for conn in self.conns:
            conn.send((num_blocks, kv_dtype, eos_token_ids, block_size))
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            _expect(conn, proc, rank, "ready")
        return _Driver(runner, self)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _expect(conn: Connection, proc: BaseProcess, rank: int, status: str) -> None:
    """Wait for a worker's `status` message; RuntimeError if it sends another or dies."""
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(
                f"tensor-parallel rank {rank} exited with code {proc.exitcode} while starting "
                "(its log is above; a script that starts Loom with tensor parallel must guard "
                "its entry point with `if __name__ == '__main__':`, as spawned processes "
                "import it)")
    got = conn.recv()
    if got != status:
        raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {got}")


class _Driver:
    """The engine's runner under TP: each execute_model goes to every rank. Other attributes
    are rank 0's runner's."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel) -> None:
        self._runner = runner
        self._tp = tp
        self._last: dict[str, int] = {}  # rank 0's tokens of the last step, by request

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for conn in self._tp.conns:
            conn.send((so, self._last))
        out = self._runner.execute_model(so)
        self._last = {r: t[0] for r, t in zip(out.req_ids, out.sampled_token_ids) if t}
        return out

    def close(self) -> None:
        self._tp.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def _take_tokens(runner: ModelRunner, tokens: dict[str, int]) -> None:
    """Rank 0's sampled tokens replace this rank's (equal unless sampling drew differently)."""
    for req_id, token in tokens.items():
        state = runner.requests.get(req_id)
        if state is not None and state.output_token_ids and state.output_token_ids[-1] != token:
            state.output_token_ids[-1] = token
            state.token_ids[-1] = token


def worker_main(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """A worker rank: join the group, load and slice the model, then execute each step."""
    from loom.loader.model_loader import load_model
    from loom.threads import apply_thread_defaults, set_num_threads
    from loom.worker.model_runner import ModelRunner

    conn.send("started")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    apply_thread_defaults()
    set_num_threads(spec.num_threads)
    device = _rank_device(torch.device(spec.device), rank)
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    dist.init_process_group(_backend(device), init_method=spec.init_method, rank=rank,
                            world_size=spec.world, timeout=COLLECTIVE_TIMEOUT)
    try:
        loaded = load_model(spec.source, spec.dtype, device, quantization=spec.quantization,
                            cpu_kernels=spec.cpu_kernels, batch_invariant=spec.batch_invariant)
        config = shard_model(loaded.model, loaded.config, rank, spec.world)
        num_blocks, kv_dtype, eos, block_size = conn.recv()
        runner = ModelRunner(loaded.model, config, eos, block_size, num_blocks, kv_dtype, device)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if msg is None:
            break
        so, tokens = msg
        _take_tokens(runner, tokens)
        runner.execute_model(so)
    dist.destroy_process_group()
