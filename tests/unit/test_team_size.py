"""loom.threads.TeamSize: the C stack's thread count chosen by measured step times."""

from __future__ import annotations

from loom.threads import TeamSize


def drive(team: TeamSize, seconds_on, calls: int, rows: int = 1) -> list[int]:
    """`calls` steps of `rows` rows, each taking seconds_on(threads, call); the sizes used."""
    used = []
    for i in range(calls):
        n = team.choose(rows)
        used.append(n)
        team.record(rows, seconds_on(n, i) * rows)
    return used


def test_a_quiet_machine_keeps_the_full_team_but_for_rare_probes() -> None:
    team = TeamSize(2, adaptive=True)
    used = drive(team, lambda n, i: 0.006 if n == 2 else 0.010, 2000)
    assert team.sizes == [2, 1]
    probes = used.count(1)
    # the first probe after FIRST_PROBE_S seconds of steps, then one every PROBE_EVERY_S
    assert 0 < probes <= TeamSize.PROBE_CALLS * (1 + 2000 * 0.006 // TeamSize.PROBE_EVERY_S)
    first = int(TeamSize.FIRST_PROBE_S / 0.006)
    assert used[-1] == 2 and used[:first] == [2] * first


def test_a_busy_core_moves_the_team_down_and_back_up_when_it_frees() -> None:
    team = TeamSize(4, adaptive=True)
    assert team.sizes == [4, 2, 1]

    def busy(n: int, i: int) -> float:  # another program holds a core for calls 200..1199
        if 200 <= i < 1200:
            return {4: 0.030, 2: 0.009, 1: 0.012}[n]
        return {4: 0.005, 2: 0.008, 1: 0.014}[n]

    used = drive(team, busy, 2000)
    assert used[150] == 4
    assert used[1150] == 2  # two threads while the core was busy (one was slower still)
    assert used[1999] == 4  # the full team once it was free again
    assert used[190:1200].count(4) < 100  # it moved down soon after the slow-down


def test_rows_buckets_are_measured_apart() -> None:
    team = TeamSize(2, adaptive=True)
    # decode steps are slow on two threads, prompt chunks (256 rows) fast on them
    for i in range(400):
        for rows in (1, 256):
            n = team.choose(rows)
            per_row = (0.02 if n == 2 else 0.008) if rows == 1 else (0.001 if n == 2 else 0.0018)
            team.record(rows, per_row * rows)
    assert team.preferred(1) == 1 and team.preferred(256) == 2


def test_off_or_one_thread_is_always_the_given_count() -> None:
    assert drive(TeamSize(2, adaptive=False), lambda n, i: 0.1 if n == 2 else 0.001, 300) \
        == [2] * 300
    assert drive(TeamSize(1, adaptive=True), lambda n, i: 0.01, 100) == [1] * 100


def test_a_bucket_that_runs_rarely_is_not_probed() -> None:
    """Probes go by a bucket's seconds of steps: 40 verify steps of 5 rows never pay one."""
    team = TeamSize(2, adaptive=True)
    assert drive(team, lambda n, i: 0.006 if n == 2 else 0.010, 40, rows=5) == [2] * 40


def test_long_steps_are_probed_by_their_cost() -> None:
    """A long prompt's steps (16 s each) pay a probe (3 calls, maybe at half speed) at most
    every PROBE_CALLS / PROBE_SHARE calls, not after each."""
    team = TeamSize(2, adaptive=True)
    used = drive(team, lambda n, i: (16.0 if n == 2 else 30.0) / 1476, 400, rows=1476)
    assert used[:4] == [2] * 4
    assert 0 < used.count(1) <= TeamSize.PROBE_CALLS * (1 + 400 * TeamSize.PROBE_SHARE
                                                         / TeamSize.PROBE_CALLS)
    assert used.count(1) <= 400 * TeamSize.PROBE_SHARE * 1.5


def test_long_steps_still_move_down_when_a_core_is_taken() -> None:
    team = TeamSize(2, adaptive=True)

    def busy(n: int, i: int) -> float:  # a core taken from call 20 on: two threads 4x slower
        return (2.0 if n == 2 else 3.0) / 512 if i < 20 else (8.0 if n == 2 else 3.2) / 512

    used = drive(team, busy, 120, rows=512)
    assert used[-1] == 1 and used[20:120].count(2) < 60
