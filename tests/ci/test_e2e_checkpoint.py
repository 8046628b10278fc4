"""The hybrid natural runs (scenarios.LFM2_CHECKPOINT, GDN_CHECKPOINT, LFM2_NATURAL, GDN_NATURAL):
their plan, what the hook counts of series entry 0017 and how their verdicts judge a run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "ci" / "e2e"), str(ROOT / "ci" / "e2e" / "hook")]

import sitecustomize as hook  # noqa: E402
from e2e_harness import traffic  # noqa: E402
from e2e_harness.plan import CPU_DEFAULT_RUNS, CPU_PLAN, RunSpec, runs_not_on_line  # noqa: E402
from e2e_harness.scenarios import (  # noqa: E402
    GDN_CHECKPOINT,
    GDN_NATURAL,
    LFM2_CHECKPOINT,
    LFM2_NATURAL,
    NATURAL,
    Scenario,
)
from e2e_harness.verdicts import Run, judge  # noqa: E402

KINDS = ("control", "pristine", "patched")
HYBRID_NATURAL = (LFM2_CHECKPOINT, GDN_CHECKPOINT, LFM2_NATURAL, GDN_NATURAL)
MAMBA_ASSERTION = (
    "AssertionError: Can not alloc mamba cache (raised in /x/sites/pristine/sglang/srt/mem_cache/"
    "unified_cache/components/mamba.py:_alloc_mamba_slot)"
)
KV_MISS = "RuntimeError: Out of memory (raised in /x/sglang/srt/mem_cache/allocation.py:alloc_token_slots)"


def specs(scenario: Scenario) -> dict[str, RunSpec]:
    return {spec.name: spec for spec, _ in CPU_PLAN if spec.scenario is scenario}


def flag(spec: RunSpec, name: str) -> str:
    flags = spec.server_flags_of_scenario()
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize("scenario", HYBRID_NATURAL, ids=lambda s: s.name)
def test_each_hybrid_natural_scenario_runs_on_one_rank_and_two(scenario: Scenario) -> None:
    found = specs(scenario)
    assert set(found) == {f"{ranks}{scenario.name}-{kind}" for ranks in ("", "tp2-") for kind in KINDS}
    assert {spec.control_name for spec in found.values()} == {
        f"{scenario.name}-control",
        f"tp2-{scenario.name}-control",
    }
    assert all(spec.tp == 2 and spec.rank_local for name, spec in found.items() if name.startswith("tp2-"))
    assert scenario.mamba_state and not scenario.injects and scenario.model in ("lfm2", "gdn")
    assert scenario.gdn_kernels == (scenario.model == "gdn")
    # shortest-prefill-first and its chunk limit came in 0.5.21
    assert runs_not_on_line(list(found), "0.5.20") and not runs_not_on_line(list(found), "0.5.21")


@pytest.mark.parametrize("scenario", (LFM2_CHECKPOINT, GDN_CHECKPOINT), ids=lambda s: s.name)
def test_a_checkpoint_run_has_write_through_slow_copies_and_sglangs_own_mamba_sizing(
    scenario: Scenario,
) -> None:
    for spec in specs(scenario).values():
        assert flag(spec, "--hicache-write-policy") == "write_through", spec.name
        assert flag(spec, "--max-total-tokens") == "16384", spec.name  # no KV miss: only the Mamba slot's
        # the stand-in's own copy delay: 0.3 s (natural-hicache's) made the patched two-rank
        # server wait for the copies so long that its requests timed out
        assert "CARRY_E2E_COPY_DELAY_S" not in dict(spec.extra_env), spec.name
        # sglang caps the running requests by this pool (3 slots a request); the control's is roomy
        assert flag(spec, "--max-mamba-cache-size") == ("256" if spec.kind == "control" else "16"), spec.name
    assert scenario.mamba_checkpoints


def test_only_lfm2s_two_rank_checkpoint_runs_are_in_the_default_run() -> None:
    default = {name for scenario in HYBRID_NATURAL for name in specs(scenario) if name in CPU_DEFAULT_RUNS}
    assert default == {name for name in specs(LFM2_CHECKPOINT) if name.startswith("tp2-")}


def test_the_hybrid_kv_natural_runs_are_natural_with_a_mamba_pool_that_never_runs_out() -> None:
    for spec in specs(LFM2_NATURAL).values():
        flags = spec.server_flags_of_scenario()
        base = NATURAL.control_flags if spec.kind == "control" else NATURAL.flags
        assert flags[: len(base)] == base and flag(spec, "--max-mamba-cache-size") == "256"
        assert "--enable-hierarchical-cache" not in flags
    assert not LFM2_NATURAL.mamba_checkpoints


def test_the_hook_counts_mamba_slot_misses_where_the_tree_records_them(tmp_path: Path) -> None:
    recorded: list[str] = []

    class MambaComponent:
        def _record_slot_miss(self, outcome: str) -> None:
            recorded.append(outcome)

    injector = hook.Injector(limit=0, counters_dir=tmp_path)
    hook.wrap_mamba_slot_misses(MambaComponent, injector)
    MambaComponent()._record_slot_miss("rescued")
    MambaComponent()._record_slot_miss("checkpoint_skipped")
    assert recorded == ["rescued", "checkpoint_skipped"]
    assert json.loads((tmp_path / f"{os.getpid()}.json").read_text())["mamba_slot_misses"] == 2

    pristine = type("MambaComponent", (), {})
    hook.wrap_mamba_slot_misses(pristine, injector)  # nothing to count, nothing wrapped
    assert not hasattr(pristine, "_record_slot_miss")


def _judged(kind: str, tp: int = 1, **counters: Any) -> Run:
    run = Run("lfm2", f"lfm2-checkpoint-{kind}", kind, tp=tp, started=True, mamba_checkpoints=True)
    for name, value in counters.items():
        setattr(run, name, value)
    if kind == "patched":  # what the server's /metrics showed: the hook's own count
        run.scraped = {"sglang:mamba_slot_misses_total": dict(run.mamba_slot_misses)}
    outcomes = [traffic.Outcome(key, kind != "pristine", [1]) for key in ("long", "short.0")]
    judge(run, outcomes, {"long": [1], "short.0": [1]}, LFM2_CHECKPOINT)
    return run


@pytest.fixture
def two_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traffic, "NATURAL_SHORT_REQUESTS", 1)


def test_pristine_must_die_of_the_mamba_checkpoints_assertion(two_requests: None) -> None:
    died = _judged("pristine", server_died=True, died_with={"0": MAMBA_ASSERTION})
    assert (
        died.ok
        and died.verdict == "the scheduler died with the Mamba checkpoint's assertion (as expected; rank 0)"
    )
    other = _judged("pristine", server_died=True, died_with={"0": KV_MISS})
    assert not other.ok and other.verdict.startswith(
        "the server died, but no scheduler of the Mamba checkpoint's"
    )
    survived = _judged("control")  # judged as pristine below: it answered everything
    survived = Run("lfm2", "lfm2-checkpoint-pristine", "pristine", started=True, mamba_checkpoints=True)
    judge(survived, [traffic.Outcome(k, True, [1]) for k in ("long", "short.0")], None, LFM2_CHECKPOINT)
    assert not survived.ok and survived.verdict == "no natural miss this time: pristine survived its traffic"
    assert survived.natural_miss_absent and not died.natural_miss_absent and not other.natural_miss_absent


def test_patched_must_recover_a_slot_miss_on_every_rank(two_requests: None) -> None:
    one = _judged("patched", mamba_slot_misses={"0": 16})
    assert one.ok and one.verdict.startswith("every request finished, every rank recovered Mamba slot misses")
    none = _judged("patched", mamba_slot_misses={"0": 0})
    assert not none.ok and none.verdict == "no natural miss this time: no rank recovered Mamba slot misses"
    assert none.natural_miss_absent  # started again (runner.NATURAL_ATTEMPTS)
    alone = _judged("patched", tp=2, mamba_slot_misses={"0": 3, "1": 0})
    assert not alone.ok and not alone.natural_miss_absent  # one rank alone is a divergence, not chance
    died = _judged("patched", mamba_slot_misses={"0": 0}, died_with={"0": MAMBA_ASSERTION})
    assert not died.ok and not died.natural_miss_absent


def test_a_control_with_a_mamba_slot_miss_is_no_reference(two_requests: None) -> None:
    control = _judged("control", mamba_slot_misses={"0": 1})
    assert not control.ok and "Mamba slot misses {'0': 1}" in control.verdict
    assert _judged("control").ok
