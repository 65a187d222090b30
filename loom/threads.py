"""CPU threads for torch: the OpenMP wait policy and the thread count.

By default torch's OpenMP (libgomp) threads spin ~300,000 times between parallel regions. When
another process holds a core (a shared machine, a benchmark client next to the server), each
parallel op then waits a scheduler time slice for its descheduled partner thread: on a 2-core
machine with a busy neighbour, SmolLM2 decode measured 1.1-1.4 tokens/s with that spinning and
7.1-8.4 with none (`OMP_WAIT_POLICY=PASSIVE`). Not spinning at all costs a wake-up per region
instead, and on a virtual machine an idle vCPU's wake-up is slow: at 32 streams (op by op, ~240
regions a step) int8 decode measured 504-543 tokens/s passive against 757-762 with a short spin
(`GOMP_SPINCOUNT=1000`, tens of microseconds), a 150-token prompt 122-142 ms against 104-118
(3 interleaved runs each, 2-core AMD EPYC VM). Beside one busy loop the short spin cost ~20% at
16 streams (245-247 against 302-307 tokens/s), not the long spin's 2-7x. So the CLI defaults
to the short spin (`OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=1000`: ACTIVE only so that libgomp
keeps the count where it manages more threads than CPUs); a user who shares the cores with busy
processes sets `OMP_WAIT_POLICY=PASSIVE`. The setting is read once, when torch loads OpenMP, so
it must be chosen before `import torch`.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
SPIN_COUNT = "1000"  # libgomp's spins (pause instructions) before a waiting thread sleeps


def openmp_env_defaults(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The variables default_openmp_env adds to `environ`: a short spin (OMP_WAIT_POLICY=ACTIVE,
    GOMP_SPINCOUNT=1000) unless it names a policy or a spin count, and one OpenBLAS thread."""
    env = {}
    if WAIT_POLICY_ENV not in environ and SPIN_COUNT_ENV not in environ:
        # ACTIVE with an explicit count: libgomp then spins SPIN_COUNT times in every team. With
        # no policy it cuts the spin to 100 once it manages more threads than there are CPUs,
        # which the server always does (the event loop's team from loading, the engine
        # thread's own): a prompt's prefill on the engine thread measured 108-119 ms against
        # 87-88 ms on the main thread, and 87-88 on both with ACTIVE.
        env = {WAIT_POLICY_ENV: "ACTIVE", SPIN_COUNT_ENV: SPIN_COUNT}
    # numpy's OpenBLAS starts a thread per core that spins after each call (blas_thread_server:
    # ~1% of a decode profile); Loom's math runs in torch and its own kernels.
    if "OPENBLAS_NUM_THREADS" not in environ:
        env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def default_openmp_env() -> bool:
    """Set openmp_env_defaults() in os.environ. Returns False (and changes nothing) when torch is
    already imported, since OpenMP has then read its environment. `import loom` calls it (so
    the CLI, and any script that imports loom before torch, get the short spin)."""
    if "torch" in sys.modules:
        return False
    os.environ.update(openmp_env_defaults())
    return True


def set_num_threads(num_threads: int | None) -> None:
    """torch's intra-op thread count; None keeps torch's default (one per core)."""
    if num_threads is None:
        return
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    import torch

    torch.set_num_threads(num_threads)
