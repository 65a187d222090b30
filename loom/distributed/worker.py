"""One tensor-parallel rank other than 0: joins the process group, loads and slices the model,
builds a ModelRunner like rank 0's, then executes each step rank 0 sends. The same class runs
in a spawned process (`worker_main`, steps over a pipe) and in a Ray actor (ray_workers.py)."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from loom.distributed.pipeline_parallel import check_splittable, split_stages
from loom.distributed.tensor_parallel import check_shardable, shard_model

if TYPE_CHECKING:
    from loom.config import ModelConfig
    from loom.core.sched_output import SchedulerOutput
    from loom.loader.resolve import ModelSource
    from loom.worker.model_runner import ModelRunner

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
    mode: str = "tp"  # "tp": tensor parallel slices; "pp": pipeline stages


def check_model(mode: str, model: torch.nn.Module, config: ModelConfig, world: int) -> None:
    """ConfigError unless `model` splits over `world` ranks this way."""
    (check_splittable if mode == "pp" else check_shardable)(model, config, world)


def prepare_rank(mode: str, model: torch.nn.Module, config: ModelConfig, rank: int,
                 world: int) -> ModelConfig:
    """Keep rank `rank`'s part of `model` (in place); returns that part's config."""
    if mode == "pp":
        return split_stages(model, config, rank, world)
    return shard_model(model, config, rank, world)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Worker:
    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        from loom.threads import apply_thread_defaults, set_num_threads

        self.rank = rank
        self.spec = spec
        apply_thread_defaults()
        set_num_threads(spec.num_threads)
        device = torch.device(spec.device)
        if device.type == "cuda":  # all GPUs visible (local processes) or one (a Ray actor)
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)  # NCCL's communicator uses the current device
        self.device = device
        if spec.seed is not None:
            torch.manual_seed(spec.seed)
        self.runner: ModelRunner | None = None

    def ping(self) -> str:
        return "started"

    def join(self) -> None:
        """Blocks until every rank has joined (rank 0 last)."""
        dist.init_process_group(backend_for(self.device), init_method=self.spec.init_method,
                                rank=self.rank, world_size=self.spec.world,
                                timeout=COLLECTIVE_TIMEOUT)

    def build(self, num_blocks: int, kv_dtype: torch.dtype, eos_token_ids: tuple[int, ...],
              block_size: int) -> str:
        from loom.loader.model_loader import load_model
        from loom.worker.model_runner import ModelRunner

        s = self.spec
        loaded = load_model(s.source, s.dtype, self.device, quantization=s.quantization,
                            cpu_kernels=s.cpu_kernels, batch_invariant=s.batch_invariant)
        config = prepare_rank(s.mode, loaded.model, loaded.config, self.rank, s.world)
        self.runner = ModelRunner(loaded.model, config, eos_token_ids, block_size, num_blocks,
                                  kv_dtype, self.device)
        return "ready"

    def execute(self, so: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
        """Rank 0's tokens of the last step replace this rank's (equal unless sampling drew
        differently), then this step runs."""
        assert self.runner is not None
        for req_id, toks in tokens.items():
            state = self.runner.requests.get(req_id)
            n = len(toks)
            if state is not None and len(state.output_token_ids) >= n \
                    and state.output_token_ids[-n:] != toks:
                state.output_token_ids[-n:] = toks
                state.token_ids[-n:] = toks
        self.runner.execute_model(so)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """A spawned worker process: the protocol of mp_workers (messages over `conn`)."""
    conn.send("started")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    worker = Worker(rank, spec)
    worker.join()
    try:
        status = worker.build(*conn.recv())
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send(status)
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if msg is None:
            break
        worker.execute(*msg)
    worker.close()
