"""Tensor-parallel ranks driven by the engine.

Rank 0 is the engine's own process: one scheduler, its ModelRunner on rank 0's slices. Ranks
1..N-1 are workers (worker.py), each with a ModelRunner on its slices and a KV cache of the
same number of blocks: spawned local processes (mp_workers.py, the default) or Ray actors
placed by a placement group (ray_workers.py, `--distributed-executor-backend ray`). Each step
rank 0 sends every worker the step's SchedulerOutput (plain data; over a pipe or a Ray call)
with the tokens rank 0 sampled last step, and all ranks execute it; their forward passes meet
in the layers' collectives (torch.distributed: gloo on the CPU, NCCL on CUDA). Every rank gets
the whole logits and samples, but only rank 0's tokens count: a worker takes them over before
its next step, so the ranks' token histories never diverge.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loom.config import ConfigError
from loom.distributed.worker import (
    COLLECTIVE_TIMEOUT, WorkerSpec, backend_for, check_model, prepare_rank,
)
from loom.net import free_port
from loom.threads import default_num_threads

if TYPE_CHECKING:
    from loom.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from loom.loader.model_loader import LoadedModel
    from loom.loader.resolve import ModelSource
    from loom.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

BACKENDS = ("mp", "ray")


def default_threads(num_threads: int | None, world: int, device: torch.device) -> int | None:
    """CPU threads per rank: as given, else the engine's default (loom.threads.
    default_num_threads: its cores, within its quota) shared out."""
    if num_threads is not None or device.type != "cpu":
        return num_threads
    return max(1, default_num_threads()[0] // world)


class TensorParallel:
    """Rank 0's side: the workers (local processes or Ray actors) and `drive`."""

    def __init__(self, loaded: LoadedModel, workers: Any, threads_before: int) -> None:
        self.loaded = loaded
        self.workers = workers
        # rank 0 runs in the caller's process: its share of the cores ends with the group
        self.threads_before = threads_before

    @property
    def procs(self) -> list:
        """The local worker processes (none under Ray)."""
        return getattr(self.workers, "procs", [])

    @classmethod
    def start(cls, args: Any, source: ModelSource, device: torch.device,
              loaded: LoadedModel) -> TensorParallel:
        """Check the model splits, start the workers, join the process group and slice rank
        0's copy. `args`: the EngineArgs."""
        from loom.threads import set_num_threads

        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        if tp > 1 and pp > 1:
            raise ConfigError("--tensor-parallel-size and --pipeline-parallel-size cannot both "
                              "be above 1 yet")
        world, mode = max(tp, pp), "pp" if pp > 1 else "tp"
        executor = args.distributed_executor_backend
        if executor not in BACKENDS:
            raise ConfigError(f"unknown --distributed-executor-backend {executor!r}; choose "
                              f"from {', '.join(BACKENDS)}")
        check_model(mode, loaded.model, loaded.config, world)
        if device.type == "cuda" and executor == "mp" and torch.cuda.device_count() < world:
            raise ConfigError(f"{world} ranks need {world} GPUs; "
                              f"torch sees {torch.cuda.device_count()}")
        threads = default_threads(args.num_threads, world, device)
        host = "127.0.0.1"
        if executor == "ray":
            from loom.distributed import ray_workers

            ray_workers.connect()
            host = ray_workers.node_ip()
        spec = WorkerSpec(source, args.dtype, device.type, args.quantization, args.cpu_kernels,
                          args.batch_invariant, args.seed, threads, world,
                          f"tcp://{host}:{free_port('')}", mode)
        if executor == "ray":
            workers: Any = ray_workers.RayWorkers(spec)
        else:
            from loom.distributed.mp_workers import MPWorkers

            workers = MPWorkers(spec)
        threads_before = torch.get_num_threads()  # given back by close(), which any failure runs
        set_num_threads(threads)
        group = cls(loaded, workers, threads_before)
        try:
            workers.wait_started()
            workers.start_join()
            dist.init_process_group(backend_for(device), init_method=spec.init_method, rank=0,
                                    world_size=world, timeout=COLLECTIVE_TIMEOUT)
            workers.finish_join()
        except Exception:
            group.close()
            raise
        config = prepare_rank(mode, loaded.model, loaded.config, 0, world)
        group.loaded = replace(loaded, config=config)
        logger.info("%s parallel: %d ranks over %s, workers: %s (%s threads each)",
                    "pipeline" if mode == "pp" else "tensor", world, backend_for(device),
                    executor, threads)
        return group

    def drive(self, runner: ModelRunner, num_blocks: int, kv_dtype: torch.dtype,
              eos_token_ids: tuple[int, ...], block_size: int) -> _Driver:
        """Have every worker build its runner like rank 0's; the wrapper to step them all."""
        self.workers.build(num_blocks, kv_dtype, eos_token_ids, block_size)
        return _Driver(runner, self)

    def close(self) -> None:
        self.workers.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.threads_before)


class _Driver:
    """The engine's runner under TP: each execute_model goes to every rank. Other attributes
    are rank 0's runner's."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel) -> None:
        self._runner = runner
        self._tp = tp
        self._last: dict[str, list[int]] = {}  # rank 0's tokens of the last step, by request

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._tp.workers.step(so, self._last)
        out = self._runner.execute_model(so)
        self._last = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids) if t}
        return out

    def close(self) -> None:
        self._tp.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
