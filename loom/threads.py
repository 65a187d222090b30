"""CPU threads for torch: the OpenMP wait policy and the thread count.

By default torch's OpenMP threads spin between parallel regions. When another process holds a
core (a shared machine, a benchmark client next to the server), each parallel op then waits a
scheduler time slice for its descheduled partner thread: on a 2-core machine with a busy
neighbour, SmolLM2 decode measured 1.1-1.4 tokens/s with spinning and 7.1-8.4 with a passive
policy (and 6.9-8.0 with one thread). With nothing competing, passive measured 0-8% slower
(wake-ups); `OMP_WAIT_POLICY=ACTIVE` restores spinning. The policy is read once, when torch loads
OpenMP, so it must be chosen before `import torch`.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def default_openmp_env() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user chose a policy. Returns False (and changes
    nothing) when torch is already imported, since OpenMP has then read its environment."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")
    # numpy's OpenBLAS starts a thread per core that spins after each call (blas_thread_server:
    # ~1% of a decode profile); Loom's math runs in torch and its own kernels.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    return True


def set_num_threads(num_threads: int | None) -> None:
    """torch's intra-op thread count; None keeps torch's default (one per core)."""
    if num_threads is None:
        return
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    import torch

    torch.set_num_threads(num_threads)
