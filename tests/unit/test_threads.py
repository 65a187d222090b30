"""CPU thread settings: no side effect on `import loom`, the OpenMP defaults where an engine
starts (only for variables the user has not set), and --num-threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from loom.distributed.executor import default_threads
from loom.entrypoints.cli import main
from loom.threads import (
    SPIN_COUNT_ENV,
    WAIT_POLICY_ENV,
    apply_thread_defaults,
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


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs to pin to one")
def test_default_threads_follow_the_cpu_affinity() -> None:
    """An engine pinned to one CPU (taskset, a container's cpuset) runs one thread by default,
    not os.cpu_count()'s."""
    one = min(os.sched_getaffinity(0))
    code = ("import torch; from loom.distributed.executor import default_threads; "
            "print(default_threads(None, 1, torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert out.stdout.split() == ["1"]
    assert default_threads(None, 1, torch.device("cpu")) == len(os.sched_getaffinity(0))


def test_cli_rejects_a_bad_thread_count(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--num-threads", "0"])
    assert e.value.code == 2 and "--num-threads: must be at least 1" in capsys.readouterr().err
