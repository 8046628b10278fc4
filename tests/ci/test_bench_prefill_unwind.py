"""ci/bench/prefill_unwind.py: how its exit status is decided from a run's figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script

bench = load_script(
    "prefill_unwind", Path(__file__).resolve().parents[2] / "ci" / "bench" / "prefill_unwind.py"
)


def test_the_plain_ratio_is_judged_against_the_target_plus_the_runs_own_floor() -> None:
    # A decode run on this machine: 1.0207, its two pristine processes 0.9842 apart.
    assert bench.plain_pool_limit(0.9842) == pytest.approx(1.0358)
    assert bench.plain_pool_failures(1.0207, 0.9842) == []
    # The same distance above 1 widens it alike.
    assert bench.plain_pool_failures(1.0300, 1.0158) == []
    # Where the floor is 1 the target is the target.
    (failure,) = bench.plain_pool_failures(1.0207, 1.0)
    assert failure == "plain pools: ratio 1.0207 > 1.0200 (1.02 + the floor's 0.0000)"
    # A cost past the target by more than the run's noise fails.
    assert bench.plain_pool_failures(1.05, 0.99)


def test_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.verdict(0.99, timed=[], counted=[]) == 0
    assert bench.verdict(0.99, timed=["plain pools: slow"], counted=[]) == 1
    assert "bench: over target: plain pools: slow" in capsys.readouterr().out
    assert bench.verdict(0.99, timed=[], counted=["credited decode steps: 1.00 all-reduces per step"]) == 1


def test_a_run_whose_floor_is_too_far_from_1_judges_only_what_it_counts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert not bench.floor_too_far(1.049) and not bench.floor_too_far(0.951)
    assert bench.floor_too_far(1.06) and bench.floor_too_far(0.94)
    assert bench.verdict(1.06, timed=["plain pools: slow"], counted=[]) == 2
    printed = capsys.readouterr()
    assert "slow" not in printed.out
    assert printed.err.strip() == (
        "bench: error: pristine/pristine read 1.0600, more than 5% from 1, so the timed targets were not"
        " judged: run it again on an idle machine"
    )
    # A count is exact, whatever the floor.
    assert bench.verdict(1.06, timed=[], counted=["elastic pool: 2.00 all-reduces per round"]) == 1
