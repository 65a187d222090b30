"""Work a test needs that depends on nothing the run does before it (compiling every kernel
variant with clang and the AArch64 cross gcc, a fresh cache's first build), started when
collection ends in the idle scheduling class, so it runs on the core the rest of the run leaves
idle: much of the suite is one-threaded (tokenizers, converters, servers starting), and a
2-core run of it left ~750 core-seconds idle. The test then waits for its job and checks what
it left, exactly as if it had run the command itself; run alone, the job runs while it waits.

A test names its job with `@pytest.mark.background(name, argv, env)` (a command and its
environment, `{out}` in them replaced by a folder of the job's own); `result(name)` waits for
it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    proc: subprocess.Popen
    out: Path  # the job's folder: its stdout and stderr, and whatever it writes there


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    out: Path


_jobs: dict[str, Job] = {}


def _background() -> None:
    """In the job's process (its compilers inherit it): a process group of its own (to be killed
    whole) in the run's session, and the idle scheduling class (any ordinary thread waking on
    the core preempts it at once). Not a session of its own: Linux's autogroups give each
    session an equal share of the CPU whatever its processes' priorities, and the first tests
    beside the jobs took 1.7-4.7x their time alone on the 2-core Zen 3 VM."""
    os.setpgid(0, 0)
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """Start job `name` (once: several tests may name it) in the idle scheduling class."""
    if name in _jobs:
        return
    out = Path(tempfile.mkdtemp(prefix=f"loom-bg-{name}-"))
    fill = lambda a: a.replace("{out}", str(out))  # noqa: E731
    with open(out / "stdout", "wb") as o, open(out / "stderr", "wb") as e:
        proc = subprocess.Popen(
            [fill(a) for a in argv], cwd=ROOT, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
            env=None if env is None else {k: fill(v) for k, v in env.items()},
            preexec_fn=_background)
    _jobs[name] = Job(proc, out)


def result(name: str, timeout: float = 1200) -> Result:
    """What job `name` gave, waiting for it (while the test waits, the job has the cores)."""
    job = _jobs[name]
    rc = job.proc.wait(timeout)
    read = lambda f: (job.out / f).read_text(errors="replace")  # noqa: E731
    return Result(rc, read("stdout"), read("stderr"), job.out)


def stop_all() -> None:
    """Kill whatever is still running (a run stopped early) and remove the jobs' folders."""
    for job in _jobs.values():
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, 9)
            job.proc.wait()
        shutil.rmtree(job.out, ignore_errors=True)
    _jobs.clear()
