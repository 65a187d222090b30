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
        set_num_threads(None)
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="at least 1, got 0"):
            set_num_threads(0)
    finally:
        torch.set_num_threads(before)


def _default_threads_in(preexec_fn) -> int:  # noqa: ANN001
    """default_threads' answer in a fresh Python process, `preexec_fn` run in it first."""
    code = ("import torch; from loom.distributed.executor import default_threads; "
            "print(default_threads(None, 1, torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=preexec_fn)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs to pin to one")
def test_default_threads_follow_the_cpu_affinity() -> None:
    """An engine pinned to one CPU (taskset, a container's cpuset) runs one thread by default,
    not os.cpu_count()'s."""
    one = min(os.sched_getaffinity(0))
    assert _default_threads_in(lambda: os.sched_setaffinity(0, {one})) == 1
    assert default_threads(None, 1, torch.device("cpu")) == len(os.sched_getaffinity(0))


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
