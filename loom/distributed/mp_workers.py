"""Worker ranks as spawned local processes, each driven over a pipe (the default backend)."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from loom.distributed.worker import WorkerSpec, worker_main

if TYPE_CHECKING:
    from loom.core.sched_output import SchedulerOutput


class MPWorkers:
    def __init__(self, spec: WorkerSpec) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(1, spec.world):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, spec, theirs), daemon=True,
                            name=f"loom-tp-rank{rank}")
            p.start()
            self.procs.append(p)
            self.conns.append(ours)

    def wait_started(self) -> None:
        self._expect_all("started")

    def start_join(self) -> None:
        """Nothing to do: a worker joins the group as soon as it has started."""

    def finish_join(self) -> None:
        pass

    def build(self, *args: Any) -> None:
        for conn in self.conns:
            conn.send(args)
        self._expect_all("ready")

    def step(self, so: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
        for conn in self.conns:
            conn.send((so, tokens))

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

    def _expect_all(self, status: str) -> None:
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {proc.exitcode} while "
                        "starting (its log is above; a script that starts Loom with tensor "
                        "parallel must guard its entry point with `if __name__ == "
                        "'__main__':`, as spawned processes import it)")
            got = conn.recv()
            if got != status:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {got}")
