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

import collections
import dataclasses
import functools
import logging
import os
import statistics
import sys

from loom.darwin import compute_cores

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


def available_cpus() -> int:
    """The CPUs this process may use: its affinity (taskset, a container's cpuset) and its CPU
    quota (`docker --cpus`, a Kubernetes CPU limit: cgroups' cpu.max / cfs_quota_us), both of
    which `os.cpu_count()` ignores (a server pinned to 2 of 16 cores, or limited to 2 CPUs' time
    on them, would start 16 threads, which a quota then throttles in turn). For pools of
    independent jobs (compiles, quantizing tensors); compute threads: default_num_threads."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return _within(cpus or 1, cpu_quota())


def _within(threads: int, quota: float | None) -> int:
    """`threads` capped by a CPU quota, rounded down (OpenMP's threads wait for each other at
    every parallel region: one throttled thread stalls them all), to 1 at least."""
    return threads if quota is None else max(1, min(threads, int(quota)))


def default_num_threads() -> tuple[int, str]:
    """The engine's compute threads when --num-threads is not given, and why that many: one per
    core this process may use on the CPU's fastest kind of core (math_cores on Linux,
    loom.darwin.compute_cores on macOS), within its CPU quota. torch's own default counts
    every physical core and sees no quota. OMP_NUM_THREADS, where set, is taken as torch takes
    it (its first number)."""
    given = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if given.isdigit() and int(given) > 0:
        return int(given), "OMP_NUM_THREADS"
    if hasattr(os, "sched_getaffinity"):
        cores, why = math_cores(os.sched_getaffinity(0))
    else:
        cores = compute_cores()
        why = ("one per performance core (Apple Silicon) or physical core, from sysctl" if cores
               else "one per CPU")
        cores = cores or os.cpu_count() or 1
    quota = cpu_quota()
    threads = _within(cores, quota)
    if threads < cores:
        why += f", within a CPU quota of {quota:g}"
    return threads, why


def _cpulist(text: str | None) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as its CPU numbers; empty for None or ""."""
    cpus: set[int] = set()
    for part in (text or "").split(","):
        if part.strip():
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def math_cores(cpus: set[int], devices: str = "/sys/devices") -> tuple[int, str]:
    """How many compute threads `cpus` (Linux CPU numbers: the affinity) are worth, and why:
    - on a CPU with two kinds of core, the faster kind alone: the kernels' threads split each
      op evenly and wait for each other at its end, so one on a slow core holds back the rest.
      Intel's hybrids (Alder Lake on) list their performance cores in /sys/devices/cpu_core/cpus
      (the efficiency ones in cpu_atom): those, as llama.cpp and Ollama count them. Elsewhere
      (ARM's big.LITTLE, whose Linux gives each CPU a cpu_capacity, 1024 for the fastest) the
      fastest n CPUs for the n that maximises n times the slowest one's capacity: the work
      evenly split goes at that pace (4 big cores at 1024 beat them with 4 little ones at 410
      beside: 4096 > 3280);
    - one thread per physical core (core_cpus_list: its hyperthreads), as torch and llama.cpp
      default to: two hyperthreads share one core's vector units.
    A CPU whose files are missing counts as a core of its own."""
    cpu = f"{devices}/system/cpu/cpu%d"
    kinds = ""
    p_cores = _cpulist(_read(f"{devices}/cpu_core/cpus"))
    given = len(cpus)
    if _read(f"{devices}/cpu_atom/cpus") is not None and cpus & p_cores and cpus - p_cores:
        cpus, kinds = cpus & p_cores, " on the performance cores (Intel's cpu_core)"
    else:
        caps = {c: _read(cpu % c + "/cpu_capacity") for c in cpus}
        if all(v and v.isdigit() for v in caps.values()) and len(set(caps.values())) > 1:
            ranked = sorted((int(v) for v in caps.values()), reverse=True)
            n = max(range(1, len(ranked) + 1), key=lambda k: (k * ranked[k - 1], -k))
            cpus = {c for c in cpus if int(caps[c]) >= ranked[n - 1]}
            kinds = f" on the fastest (cpu_capacity {ranked[n - 1]} and up, of {ranked[0]})"
    siblings = {frozenset(_cpulist(_read(cpu % c + "/topology/core_cpus_list")
                                   or _read(cpu % c + "/topology/thread_siblings_list"))
                          or {c}) for c in cpus}
    return len(siblings), (f"one per physical core{kinds}: {len(siblings)} cores of the {given} "
                           "CPUs this process may use")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _limit_v2(folder: str) -> float | None:
    parts = (_read(os.path.join(folder, "cpu.max")) or "max").split()
    return None if parts[0] == "max" else int(parts[0]) / int(parts[1])


def _limit_v1(folder: str) -> float | None:
    quota, period = (_read(os.path.join(folder, f"cpu.cfs_{k}_us")) for k in ("quota", "period"))
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def _has_cpu(controllers: str) -> bool:  # "cpu,cpuacct" and the like (cgroup v1)
    return "cpu" in controllers.split(",")


def cpu_quota(proc: str = "/proc/self") -> float | None:
    """The CPU time this process's cgroups allow, in CPUs (the smallest limit from its cgroup up
    to the hierarchy's root, cgroup v2 or v1's cpu controller), or None where none is set or
    none can be read."""
    groups = _read(os.path.join(proc, "cgroup"))
    mounts = _read(os.path.join(proc, "mountinfo"))
    if groups is None or mounts is None:
        return None
    found: list[float] = []
    for line in mounts.splitlines():  # id parent dev root mountpoint opts ... - type source super
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        root, point, fstype = fields[3], fields[4], fields[dash + 1]
        v2 = fstype == "cgroup2"
        if not v2 and (fstype != "cgroup" or not _has_cpu(fields[-1])):
            continue
        limit = _limit_v2 if v2 else _limit_v1
        for entry in groups.splitlines():  # hierarchy:controllers:path
            _, ctl, path = entry.split(":", 2)
            if not (ctl == "" if v2 else _has_cpu(ctl)):  # v2's one hierarchy; v1's cpu one
                continue
            rel = os.path.relpath(path, root)  # a cgroup outside the mount's root: the mount's
            outside = rel == ".." or rel.startswith("../")
            parts = [] if outside else [p for p in rel.split("/") if p != "."]
            for depth in range(len(parts), -1, -1):  # the cgroup, then each parent up to the root
                got = limit(os.path.join(point, *parts[:depth]))
                if got is not None:
                    found.append(got)
    return min(found) if found else None


def set_num_threads(num_threads: int | None) -> None:
    """torch's intra-op thread count (the C kernels take the same); None: default_num_threads(),
    logged once per count."""
    if num_threads is None:
        num_threads, why = default_num_threads()
        _log_default(num_threads, why)
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    import torch

    torch.set_num_threads(num_threads)


@functools.cache
def _log_default(threads: int, why: str) -> None:
    logger.info("CPU threads: %d (%s; --num-threads overrides)", threads, why)


class TeamSize:
    """How many threads the one-call C stack (loom.models.q8_decoder) runs a step on, by
    measurement: a team waits at a barrier between every two ops for its slowest thread, so when
    another program holds a core (a compile in another terminal: Linux's autogroups give each
    session an equal share whatever the nice values), a thread of the team is descheduled for a
    time slice at a time and every other thread waits it out. On the 2-core Zen 4 VM with two
    compile jobs in another session, the 135M model decoded 21-37 tok/s on two threads and
    88-97 on one (143-159 on two with the machine to itself), 2026-12-02.

    Sizes form a ladder (the team, half of it, ... 1). Per bucket of step rows (a decode step
    and a prompt's chunk differ) each call's time a row is recorded; when the preferred size's
    recent median rises past SLOW times its best, after the bucket's first FIRST_PROBE_S seconds
    of steps (a start under load has no better best), and every PROBE_EVERY_S seconds anyway
    (PROBE_UP_S when below the full team, to come back once the other program is done), the
    next size down (or up) runs PROBE_CALLS calls, and it becomes the preferred one when its
    median is under WIN times the current one's. Probes go by the bucket's time, not its calls,
    so their cost stays a bounded share (~0.2-1% quiet) and a bucket that runs rarely (a
    speculative step of 5 rows) probes rarely; and by the calls' length: a probe's PROBE_CALLS
    calls take at most PROBE_SHARE of the bucket's time since the last (SLOW_SHARE when its steps
    slowed down). Without that a long prompt's steps (16 s each for 1476 tokens of the 1.7B
    shape) were probed after every call on a quiet machine: three of every four on one thread.
    The C kernels give the same bits on any team size (each output is summed by one thread in a
    fixed order), so only speed changes.
    `LOOM_ADAPTIVE_THREADS=0` keeps the full team."""

    SLOW = 1.5
    WIN = 0.85
    PROBE_CALLS = 3
    FIRST_PROBE_S = 2.0  # seconds of a bucket's steps before its first probe
    PROBE_EVERY_S = 10.0  # ... between probes down from the full team
    PROBE_UP_S = 1.0  # ... between probes back up while below it
    RECENT = 8
    PROBE_SHARE = 0.02  # most of a bucket's time its scheduled probes may take
    SLOW_SHARE = 0.1  # ... and those a slow-down sets off

    def __init__(self, threads: int, adaptive: bool | None = None) -> None:
        if adaptive is None:
            adaptive = os.environ.get("LOOM_ADAPTIVE_THREADS", "1") != "0"
        self.sizes = [threads]
        while adaptive and self.sizes[-1] > 1:
            self.sizes.append(self.sizes[-1] // 2)
        self._buckets: dict[int, _Bucket] = {}

    def choose(self, rows: int) -> int:
        """The team size for a step of `rows` rows."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        b = self._bucket(rows)
        return self.sizes[b.probe if b.probe_left else b.at]

    def record(self, rows: int, seconds: float) -> None:
        """A call of `rows` rows took `seconds` on the size `choose(rows)` said just before."""
        if len(self.sizes) == 1 or rows <= 0:
            return
        b, per_row = self._bucket(rows), seconds / rows
        if b.probe_left:
            b.probed.append(per_row)
            b.probe_left -= 1
            if not b.probe_left:
                self._settle(b)
            return
        b.recent.append(per_row)
        b.best = min(b.best, per_row)
        b.spent += seconds
        if len(b.recent) < 4:
            return
        due = self.PROBE_UP_S if b.at else self.PROBE_EVERY_S if b.settled else self.FIRST_PROBE_S
        median = statistics.median(b.recent)
        probe_s = self.PROBE_CALLS * median * rows  # a probe's time, about
        slow = (b.at + 1 < len(self.sizes) and median > self.SLOW * b.best
                and b.spent >= probe_s / self.SLOW_SHARE)
        if slow or b.spent >= max(due, probe_s / self.PROBE_SHARE):
            # down when slow (or steady at the full team), else up toward the full team
            b.probe = b.at + 1 if (slow or not b.at) and b.at + 1 < len(self.sizes) else b.at - 1
            b.probe_left, b.probed, b.spent = self.PROBE_CALLS, [], 0.0

    def preferred(self, rows: int) -> int:
        """The size steps of `rows` rows run on outside probes."""
        return self.sizes[self._bucket(rows).at]

    def _settle(self, b: _Bucket) -> None:
        b.settled = True
        theirs = statistics.median(b.probed[1:] or b.probed)  # the first wakes the threads
        mine = statistics.median(b.recent) if b.recent else float("inf")
        if theirs < self.WIN * mine:
            logger.info("CPU stack: %d thread(s) for steps of ~%d rows (%.3g ms a row against "
                        "%.3g on %d: other programs hold cores)" if b.probe > b.at else
                        "CPU stack: back to %d thread(s) for steps of ~%d rows (%.3g ms a row "
                        "against %.3g on %d)", self.sizes[b.probe], 1 << b.key >> 1,
                        theirs * 1e3, mine * 1e3, self.sizes[b.at])
            b.at = b.probe
            b.recent = collections.deque(b.probed[1:] or b.probed, maxlen=self.RECENT)
            b.best = min(b.recent)
        elif b.recent:
            b.best = statistics.median(b.recent)  # slow at every size: today's is the baseline

    def _bucket(self, rows: int) -> _Bucket:
        key = min(rows.bit_length(), 12)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(key, collections.deque(maxlen=self.RECENT))
        return b


@dataclasses.dataclass
class _Bucket:
    key: int
    recent: collections.deque
    best: float = float("inf")
    at: int = 0  # index into TeamSize.sizes: the preferred size
    spent: float = 0.0  # seconds of calls at `at` since the last probe
    probe: int = 0
    probe_left: int = 0
    probed: list = dataclasses.field(default_factory=list)
    settled: bool = False  # a probe has run: the first comes after FIRST_PROBE_S
