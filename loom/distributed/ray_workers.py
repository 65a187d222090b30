"""Worker ranks as Ray actors (`--distributed-executor-backend ray`), one per bundle of a
placement group, so a Ray cluster (`ray start --head` / `ray start --address ...`) places
them across its nodes. The actors run the same Worker as the local processes; rank 0 (the
engine's process, the Ray driver) calls their `execute` each step. Ray is imported only here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from loom.config import ConfigError
from loom.distributed.worker import Worker, WorkerSpec

if TYPE_CHECKING:
    from loom.core.sched_output import SchedulerOutput

START_TIMEOUT_S = 600


def node_ip() -> str:
    """This node's address as Ray sees it: where the other ranks reach rank 0."""
    import ray.util

    return ray.util.get_node_ip_address()


def connect() -> None:
    """Join the running Ray cluster (RAY_ADDRESS, or one started on this machine with `ray
    start`), else start a local Ray instance; nothing if this process already did."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--distributed-executor-backend ray needs Ray: pip install "
                          "ray") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True,
                 log_to_driver=True)


class RayWorkers:
    def __init__(self, spec: WorkerSpec) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = spec.device == "cuda"
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
        self.pg = placement_group([bundle] * (spec.world - 1), strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - GetTimeoutError and kin
            raise ConfigError(f"Ray could not place {spec.world - 1} workers of {bundle} "
                              f"within {START_TIMEOUT_S} s: {e}") from None
        actor = ray.remote(Worker)
        self.actors = [
            actor.options(num_cpus=1, num_gpus=1 if gpu else 0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self.pg, placement_group_bundle_index=i)).remote(i + 1, spec)
            for i in range(spec.world - 1)]
        self._joins: list[Any] = []
        self._pending: list[Any] = []

    def wait_started(self) -> None:
        import ray

        ray.get([a.ping.remote() for a in self.actors], timeout=START_TIMEOUT_S)

    def start_join(self) -> None:
        self._joins = [a.join.remote() for a in self.actors]

    def finish_join(self) -> None:
        import ray

        ray.get(self._joins)

    def build(self, *args: Any) -> None:
        import ray

        for rank, status in enumerate(ray.get([a.build.remote(*args) for a in self.actors]), 1):
            if status != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {status}")

    def step(self, so: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
        import ray

        if self._pending:  # done by now (the ranks met in the last step's collectives)
            ray.get(self._pending)
        self._pending = [a.execute.remote(so, tokens) for a in self.actors]

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)
