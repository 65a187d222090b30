"""CPU threads for torch: the OpenMP wait policy and the thread count.

By default torch's OpenMP (libgomp) threads spin for a long while between parallel regions.
When another process holds a core (a shared machine, a benchmark client next to the server),
each parallel op then waits a scheduler time slice for its descheduled partner thread. Not
spinning at all (`OMP_WAIT_POLICY=PASSIVE`) costs a wake-up per region instead, slow for an idle
vCPU. Loom's default is a short spin (`OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=1000`, tens of
microseconds: ACTIVE only so that libgomp keeps the count where it manages more threads than
CPUs, as the server does), and one OpenBLAS thread (numpy's BLAS would otherwise start a
spinning thread per core; Loom's math runs in torch and its own kernels). A user who shares the
cores with busy processes sets `OMP_WAIT_POLICY=PASSIVE`. docs/cpu_kernels.md has the figures.

libgomp reads its environment once, when torch loads it, so the defaults must be in place before
`import torch`. `import loom` sets nothing. `apply_thread_defaults()` sets them, for the variables
the user has not set, where Loom starts an engine: the `loom` command (before anything imports
torch), `loom.LLM` (before it loads the engine) and `LLMEngine` (too late if the caller imported
torch first: then it only says so). It logs once what it did.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
SPIN_COUNT = "1000"  # libgomp's spins (pause instructions) before a waiting thread sleeps


def openmp_env_defaults(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The variables apply_thread_defaults adds to `environ`: a short spin (OMP_WAIT_POLICY=ACTIVE,
    GOMP_SPINCOUNT=1000) unless it names a policy or a spin count, and one OpenBLAS thread."""
    env = {}
    if WAIT_POLICY_ENV not in environ and SPIN_COUNT_ENV not in environ:
        # ACTIVE with an explicit count: libgomp then spins SPIN_COUNT times in every team. With
        # no policy it cuts the spin to 100 once it manages more threads than there are CPUs,
        # which the server always does (the event loop's team from loading, the engine
        # thread's own).
        env = {WAIT_POLICY_ENV: "ACTIVE", SPIN_COUNT_ENV: SPIN_COUNT}
    if "OPENBLAS_NUM_THREADS" not in environ:
        env["OPENBLAS_NUM_THREADS"] = "1"
    return env


@functools.cache
def apply_thread_defaults() -> dict[str, str]:
    """Set openmp_env_defaults() in os.environ, once per process, before torch loads OpenMP;
    returns the variables set ({} when the user set them all, or when torch came first, which
    it logs: the defaults could no longer take effect)."""
    wanted = openmp_env_defaults()
    if "torch" in sys.modules:
        if wanted:
            logger.info("torch was imported before Loom's engine: its OpenMP keeps the settings "
                        "it started with; for Loom's defaults set %s before starting Python",
                        " ".join(f"{k}={v}" for k, v in wanted.items()))
        return {}
    os.environ.update(wanted)
    if wanted:
        logger.info("thread defaults: %s (the user's environment wins; on cores shared with busy "
                    "processes set OMP_WAIT_POLICY=PASSIVE)",
                    " ".join(f"{k}={v}" for k, v in wanted.items()))
    return wanted


def set_num_threads(num_threads: int | None) -> None:
    """torch's intra-op thread count; None keeps torch's default (one per core)."""
    if num_threads is None:
        return
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    import torch

    torch.set_num_threads(num_threads)
