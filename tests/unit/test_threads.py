"""CPU thread settings: the CLI's OpenMP wait-policy default and --num-threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from loom.entrypoints.cli import main
from loom.threads import (
    SPIN_COUNT_ENV,
    WAIT_POLICY_ENV,
    default_openmp_env,
    openmp_env_defaults,
    set_num_threads,
)

_CHECK = (
    "import os, sys; from loom.threads import default_openmp_env; "
    "assert default_openmp_env(); import torch; "
    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
)


@pytest.mark.parametrize("user,expected", [
    ({}, "ACTIVE 1000"),  # the default: a short spin
    ({WAIT_POLICY_ENV: "PASSIVE"}, "PASSIVE None"),  # the user's policy, no spin count added
    ({WAIT_POLICY_ENV: "ACTIVE"}, "ACTIVE None"),
    ({SPIN_COUNT_ENV: "0"}, "None 0"),  # the user's spin count, no policy added
])
def test_short_spin_is_a_default_the_user_can_override(user, expected) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY_ENV, SPIN_COUNT_ENV)}
    env.update(user)
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == expected


@pytest.mark.parametrize("first,expected", [
    ("import loom; import torch", "ACTIVE 1000"),  # a script importing Loom first: the default
    ("import torch; import loom", "None None"),  # too late: OpenMP has read its environment
])
def test_importing_loom_first_sets_the_short_spin(first, expected) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY_ENV, SPIN_COUNT_ENV)}
    code = (f"import os; {first}; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == expected


def test_openmp_env_defaults_leave_the_users_choice() -> None:
    assert openmp_env_defaults({}) == {WAIT_POLICY_ENV: "ACTIVE", SPIN_COUNT_ENV: "1000",
                                       "OPENBLAS_NUM_THREADS": "1"}
    assert openmp_env_defaults({WAIT_POLICY_ENV: "PASSIVE", "OPENBLAS_NUM_THREADS": "4"}) == {}
    assert openmp_env_defaults({SPIN_COUNT_ENV: "0"}) == {"OPENBLAS_NUM_THREADS": "1"}


def test_too_late_once_torch_is_imported(monkeypatch) -> None:
    monkeypatch.delenv(WAIT_POLICY_ENV, raising=False)
    monkeypatch.delenv(SPIN_COUNT_ENV, raising=False)
    assert default_openmp_env() is False
    assert WAIT_POLICY_ENV not in os.environ and SPIN_COUNT_ENV not in os.environ


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


def test_cli_rejects_a_bad_thread_count(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--num-threads", "0"])
    assert e.value.code == 2 and "--num-threads: must be at least 1" in capsys.readouterr().err
