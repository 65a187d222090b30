"""CPU thread settings: no side effect on `import loom`, the OpenMP defaults where an engine
starts (only for variables the user has not set), and --num-threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom.distributed.executor import default_threads
from loom.entrypoints.cli import main
from loom.threads import (
    SPIN_COUNT_ENV,
    WAIT_POLICY_ENV,
    apply_thread_defaults,
    cpu_quota,
    default_num_threads,
    math_cores,
    openmp_env_defaults,
    set_num_threads,
)

_VARS = (WAIT_POLICY_ENV, SPIN_COUNT_ENV, "OPENBLAS_NUM_THREADS")
_SHOW = "import os; print(*(os.environ.get(k) for k in %r))" % (_VARS,)


def _run(code: str, **user: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in _VARS}
    env.update(user)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_import_loom_sets_nothing() -> None:
    assert _run(f"import loom, loom.entrypoints.cli, loom.sampling_params; {_SHOW}") == (
        "None None None")


@pytest.mark.slow
@pytest.mark.parametrize("code,expected", [
    ("import loom.engine.llm", "None None None"),  # importing the engine sets nothing either
    ("import loom; loom.LLM; import torch", "ACTIVE 1000 1"),  # the LLM class: the defaults
    ("import torch; import loom; loom.LLM", "None None None"),  # too late: only logged
])
def test_the_defaults_come_with_the_engine(code: str, expected: str) -> None:
    assert _run(f"{code}; {_SHOW}") == expected


def test_the_cli_applies_them_before_torch_loads() -> None:
    """`loom` imports every subcommand's module before it applies the defaults: none may load
    torch (or the defaults come too late for the server)."""
    code = ("import sys; from loom.entrypoints.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules)")
    assert _run(code) == "False"


def test_openmp_env_defaults_leave_the_users_choice() -> None:
    assert openmp_env_defaults({}) == {WAIT_POLICY_ENV: "ACTIVE", SPIN_COUNT_ENV: "1000",
                                       "OPENBLAS_NUM_THREADS": "1"}
    assert openmp_env_defaults({WAIT_POLICY_ENV: "PASSIVE", "OPENBLAS_NUM_THREADS": "4"}) == {}
    assert openmp_env_defaults({SPIN_COUNT_ENV: "0"}) == {"OPENBLAS_NUM_THREADS": "1"}


def test_too_late_once_torch_is_imported(monkeypatch) -> None:
    monkeypatch.delenv(WAIT_POLICY_ENV, raising=False)
    monkeypatch.delenv(SPIN_COUNT_ENV, raising=False)
    apply_thread_defaults.cache_clear()  # as if no engine had started in this process yet
    try:
        assert apply_thread_defaults() == {}
        assert WAIT_POLICY_ENV not in os.environ and SPIN_COUNT_ENV not in os.environ
    finally:
        apply_thread_defaults.cache_clear()


def test_set_num_threads() -> None:
    before = torch.get_num_threads()
    try:
        set_num_threads(1)
        assert torch.get_num_threads() == 1
        set_num_threads(None)  # the default, not torch's
        assert torch.get_num_threads() == default_num_threads()[0]
        with pytest.raises(ValueError, match="at least 1, got 0"):
            set_num_threads(0)
    finally:
        torch.set_num_threads(before)


def _default_threads_in(preexec_fn) -> int:  # noqa: ANN001
    """The threads an engine runs by default in a fresh Python process, `preexec_fn` run in it
    first: torch's count after the engine's set_num_threads(None), which the ranks' share
    (default_threads) must equal."""
    code = ("import torch; from loom.distributed.executor import default_threads; "
            "from loom.threads import set_num_threads; set_num_threads(None); "
            "print(torch.get_num_threads(), default_threads(None, 1, torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=preexec_fn)
    assert out.returncode == 0, out.stderr[-2000:]
    engine, ranks = map(int, out.stdout.split())
    assert engine == ranks
    return engine


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs to pin to one")
def test_default_threads_follow_the_cpu_affinity() -> None:
    """An engine pinned to one CPU (taskset, a container's cpuset) runs one thread by default,
    not os.cpu_count()'s."""
    one = min(os.sched_getaffinity(0))
    assert _default_threads_in(lambda: os.sched_setaffinity(0, {one})) == 1
    assert default_threads(None, 1, torch.device("cpu")) == default_num_threads()[0] >= 1


def _sysfs(tmp_path, cores: list[tuple[int, ...]], capacity: dict[int, int] | None = None,
           hybrid: tuple[str, str] | None = None) -> str:
    """A /sys/devices as Linux writes it: `cores` (each core's CPUs: its hyperthreads) in each
    CPU's topology/core_cpus_list, each CPU's cpu_capacity from `capacity`, and Intel's
    hybrid PMUs' CPU lists (`hybrid`: cpu_core's, cpu_atom's)."""
    for core in cores:
        for c in core:
            topology = tmp_path / f"system/cpu/cpu{c}/topology"
            topology.mkdir(parents=True)
            (topology / "core_cpus_list").write_text(",".join(map(str, core)) + "\n")
            if capacity:
                (topology.parent / "cpu_capacity").write_text(f"{capacity[c]}\n")
    for name, cpus in zip(("cpu_core", "cpu_atom"), hybrid or ()):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpus").write_text(cpus + "\n")
    return str(tmp_path)


def test_one_thread_per_physical_core(tmp_path) -> None:
    """An 8-core server with two hyperthreads a core (CPU i and i + 8): 8 threads, and one per
    core of those the affinity leaves."""
    sysfs = _sysfs(tmp_path, [(i, i + 8) for i in range(8)])
    assert math_cores(set(range(16)), sysfs)[0] == 8
    assert math_cores({0, 8}, sysfs)[0] == 1
    assert math_cores({0, 1, 9}, sysfs)[0] == 2
    assert math_cores({0, 1, 2}, str(tmp_path / "nothing"))[0] == 3  # no sysfs: each CPU


def test_intels_hybrids_run_on_the_performance_cores(tmp_path) -> None:
    """A Core i7-1260P's layout: 4 performance cores with two hyperthreads (CPUs 0-7), 8
    efficiency cores (8-15); a 6.x kernel's capacities too, which the PMUs' lists outrank."""
    capacity = {c: 1024 if c < 8 else 620 for c in range(16)}
    sysfs = _sysfs(tmp_path, [(0, 1), (2, 3), (4, 5), (6, 7), *[(c,) for c in range(8, 16)]],
                   capacity, hybrid=("0-7", "8-15"))
    threads, why = math_cores(set(range(16)), sysfs)
    assert threads == 4 and "performance cores" in why and "16 CPUs" in why
    assert math_cores(set(range(8, 16)), sysfs)[0] == 8  # pinned to one kind: all of them
    assert math_cores({0, 1, 8, 9}, sysfs)[0] == 1


@pytest.mark.parametrize(("capacity", "threads"), [
    ({**dict.fromkeys(range(4), 414), **dict.fromkeys(range(4, 8), 1024)}, 4),  # RK3588
    # Snapdragon 8 Gen 2's kind: 4 little, 3 big, 1 prime: the prime and big ones (4 x 870)
    ({**dict.fromkeys(range(4), 400), **dict.fromkeys(range(4, 7), 870), 7: 1024}, 4),
    ({**dict.fromkeys(range(4), 800), **dict.fromkeys(range(4, 8), 1024)}, 8),  # close: all
    (dict.fromkeys(range(8), 1024), 8),  # one kind (x86 kernels since 6.x write 1024 too)
])
def test_big_little_runs_on_the_fastest_cores(tmp_path, capacity, threads) -> None:
    sysfs = _sysfs(tmp_path, [(c,) for c in range(8)], capacity)
    assert math_cores(set(range(8)), sysfs)[0] == threads


def test_this_machines_default(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads, why = default_num_threads()
    assert 1 <= threads <= len(os.sched_getaffinity(0)) and "CPUs this process may use" in why
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")  # the user's, as torch reads it
    assert default_num_threads() == (3, "OMP_NUM_THREADS")


def _cgroup_tree(tmp_path, version: int, limits: dict[str, tuple[int, int]]):
    """A /proc/self and a cgroup mount as a process in cgroup /a/b sees them, with `limits`
    (folder under the mount -> quota, period) written in `version`'s files."""
    mount = tmp_path / "cgroup"
    for folder in ("", "a", "a/b"):
        (mount / folder).mkdir(parents=True, exist_ok=True)
    for folder, (quota, period) in limits.items():
        if version == 2:
            (mount / folder / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {period}\n")
        else:
            (mount / folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (mount / folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    if version == 2:
        (proc / "cgroup").write_text("0::/a/b\n")
        kind = f"35 25 0:30 / {mount} rw,relatime - cgroup2 cgroup2 rw"
    else:
        (proc / "cgroup").write_text("5:memory:/a/b\n3:cpu,cpuacct:/a/b\n")
        kind = f"35 25 0:30 / {mount} rw,relatime - cgroup cgroup rw,cpu,cpuacct"
    (proc / "mountinfo").write_text(f"22 1 8:1 / / rw - ext4 /dev/vda rw\n{kind}\n")
    return str(proc)


@pytest.mark.parametrize("version", [1, 2])
def test_cpu_quota_is_the_smallest_limit_up_the_cgroup_tree(tmp_path, version) -> None:
    none = _cgroup_tree(tmp_path / "none", version, {"a/b": (-1, 100000)})
    assert cpu_quota(none) is None
    nested = _cgroup_tree(tmp_path / "nested", version,
                          {"a/b": (350000, 100000), "a": (150000, 100000), "": (-1, 100000)})
    assert cpu_quota(nested) == 1.5
    assert cpu_quota(str(tmp_path / "no-proc")) is None


def _cpu_cgroup() -> Path | None:
    """A writable cgroup v1 cpu hierarchy or v2 root with the cpu controller, or None."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1
    controllers = v2 / "cgroup.subtree_control"
    if controllers.exists() and "cpu" in controllers.read_text().split() and \
            os.access(v2, os.W_OK):
        return v2
    return None


@pytest.mark.skipif(_cpu_cgroup() is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a writable cgroup with the cpu controller and two CPUs")
def test_default_threads_follow_a_cpu_quota() -> None:
    """An engine in a cgroup allowed one CPU's time (docker --cpus 1) runs one thread by
    default: a real cgroup, the subprocess moved into it before it starts Python."""
    group = _cpu_cgroup() / f"loom-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here: {e}")
    try:
        threads = _threads_in_cgroup_of_one_cpu(group)
    finally:
        group.rmdir()  # its process has exited
    assert threads == 1


def _threads_in_cgroup_of_one_cpu(group: Path) -> int:
    """`group` allowed one CPU's time, then default_threads in a process moved into it; skips
    where this machine refuses either."""
    try:
        if (group / "cpu.max").exists():
            (group / "cpu.max").write_text("100000 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot set a cgroup's CPU quota here: {e}")
    try:
        return _default_threads_in(lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    except subprocess.SubprocessError as e:  # the move into the cgroup refused
        pytest.skip(f"cannot move a process into a cgroup here: {e}")


def test_cli_rejects_a_bad_thread_count(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--num-threads", "0"])
    assert e.value.code == 2 and "--num-threads: must be at least 1" in capsys.readouterr().err
