"""What a run showed and whether that is what its kind must show. The kinds: control (no miss,
the reference), pristine (the official wheel: its scheduler must die of the allocation error),
patched (the series: every miss unwound, outputs equal the control's), without-load-wait (the
series without its load wait: the hazard must show) and recompute (every prompt recomputed: the
control's outputs must equal it). A run's evidence is its answers and the hook's counters, read
from every scheduler process (read_counters, take_counters); judge sets its verdict."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from . import metrics
from .scenarios import HICACHE, Scenario
from .traffic import Outcome, timed_out

CONTROL, PRISTINE, PATCHED, WITHOUT_LOAD_WAIT = "control", "pristine", "patched", "without-load-wait"
# The scenario's reference: the patched wheel recomputing every prompt (no prefix cache, no HiCache).
RECOMPUTE = "recompute"
INJECTING = (PRISTINE, PATCHED, WITHOUT_LOAD_WAIT)
# The kinds whose outputs are compared with their control run's.
COMPARING = (PATCHED, WITHOUT_LOAD_WAIT, RECOMPUTE)
# The pristine scheduler's own exception must be raised where sglang allocates a prefill batch: the
# allocation helpers (a KV or row miss) or the pools (a Mamba or ping-pong slot assert).
ALLOCATION_CODE = re.compile(r"sglang/srt/mem_cache/(allocation|memory_pool)\.py:")
# What upstream's rank-consensus checker logs on every rank before it stops the scheduler.
RANK_DIVERGENCE = "Found rank divergence"
# Where a Mamba checkpoint that finds no slot dies upstream (the hybrid natural runs).
MAMBA_CHECKPOINT_ASSERTION = re.compile(
    r"AssertionError: Can not alloc mamba cache \(raised in \S*sglang/srt/mem_cache/unified_cache/"
    r"components/mamba\.py:_alloc_mamba_slot\)"
)


@dataclass
class Run:
    model: str
    name: str
    kind: str
    tp: int = 1
    withheld_tokens: int = 0
    miss_at: str = "prefill"
    withheld_drift: bool = False
    scenario: str = HICACHE.name
    # HiCache's L3 tier on (the file backend): its prefetches must have served some prompt.
    l3_storage: bool = False
    # Its misses are Mamba checkpoints that find no slot (the hybrid natural runs): pristine dies
    # of the Mamba assertion, and a patched rank recovers each (series entry 0017).
    mamba_checkpoints: bool = False
    # The pool marked rank-local on every rank (as a kvcached pool is): the patched ranks agree.
    rank_local: bool = False
    # Upstream's rank-consensus checker must stop this run (its negative control), and whether it
    # stopped a run (RANK_DIVERGENCE in the server's log).
    checker_must_fire: bool = False
    rank_divergence_found: bool = False
    started: bool = False
    # The server could not bind its HTTP port (taken after it was chosen): the run is started again.
    port_taken: bool = False
    # A natural run whose traffic did not bring about the server's own miss this time (nothing
    # injected; the miss depends on timing): it showed nothing, so it fails, and is started again.
    natural_miss_absent: bool = False
    # The checker's negative control whose server died of something else first (a miss of its
    # drifting reading) before upstream's checker, which compares on a thread of its own that a
    # busy machine can hold back, reached the ranks' first divergent decision: it showed nothing
    # this time, so it fails, and is started again.
    checker_outrun: bool = False
    finished: int = 0
    failed: int = 0
    hung: bool = False
    host_cached_tokens: int = 0
    storage_cached_tokens: int = 0
    # Per TP rank (JSON keys are the rank as text), from the hook's counters in each scheduler.
    misses: dict[str, int] = field(default_factory=dict)
    unwinds: dict[str, int] = field(default_factory=dict)
    # Decode retractions after a decode step's allocation missed (the carried decode agreement).
    decode_retractions: dict[str, int] = field(default_factory=dict)
    # Parked chunked requests a decode step released rather than abort its last request.
    parked_chunk_releases: dict[str, int] = field(default_factory=dict)
    # Mamba slot allocations that found every slot held, rescued or their checkpoint skipped.
    mamba_slot_misses: dict[str, int] = field(default_factory=dict)
    # Readings of the allocator's available_size() that were reduced (withheld_tokens > 0), and how
    # many different amounts they withheld.
    withheld_readings: dict[str, int] = field(default_factory=dict)
    withheld_amounts: dict[str, int] = field(default_factory=dict)
    died_with: dict[str, str] = field(default_factory=dict)
    loads_started: int = 0
    unwinds_logged: int = 0
    server_died: bool = False
    outputs_equal_control: bool | None = None
    outputs_differing: int | None = None
    # Each request whose output differs from the control's, with how often its prefill was put
    # back (the most on any rank, from the scheduler's own unwinds).
    differing_requests: dict[str, int] = field(default_factory=dict)
    # Requests whose prefill was put back, and how often (the most on any rank).
    unwound_requests: dict[str, int] = field(default_factory=dict)
    # A hybrid model's Mamba state, from the CPU stand-ins' copy kernels in the servers: load
    # copies landed in device Mamba slots, and those that landed after their slot was released
    # (the seed's hazard, counted).
    mamba_loads: int = 0
    mamba_late_copies: int = 0
    # HiCache's L3 tier (l3_storage), per TP rank: prefetches started, and the termination checks
    # of those in flight (an all-reduce inside admission with the `timeout` policy).
    prefetches: dict[str, int] = field(default_factory=dict)
    prefetch_termination_checks: dict[str, int] = field(default_factory=dict)
    # Per TP rank: decode steps prepared, and the ranks' votes on their allocation (the agreement's
    # all-reduces made while a step was prepared).
    decode_steps: dict[str, int] = field(default_factory=dict)
    decode_votes: dict[str, int] = field(default_factory=dict)
    # Per TP rank: event-loop iterations, and the agreement's all-reduces (decode votes aside) made
    # in iterations that admitted no prefill batch (a round that admits nothing).
    iterations: dict[str, int] = field(default_factory=dict)
    idle_round_all_reduces: dict[str, int] = field(default_factory=dict)
    # A patched run's series counters read from the server's own /metrics after the traffic, per
    # TP rank (metrics.scrape); None where the run was not scraped or /metrics could not be read.
    scraped: dict[str, dict[str, int]] | None = None
    verdict: str = ""
    ok: bool = False
    seconds: float = 0.0
    peak_rss_mb: int = 0
    log: str = ""

    @property
    def showed_nothing(self) -> bool:
        """What the run is for did not happen this time, for a reason of timing: started again."""
        return self.natural_miss_absent or self.checker_outrun

    @property
    def every_rank(self) -> list[str]:
        """The run's TP ranks, as the per-rank counters name them."""
        return [str(rank) for rank in range(self.tp)]

    @property
    def injected_misses(self) -> int:
        return sum(self.misses.values())

    @property
    def recoveries(self) -> dict[str, int]:
        """What each rank did after a miss, per rank: put the prefill batch back (unwinds), or,
        after a decode miss, retract; or recover a Mamba checkpoint's slot miss."""
        if self.mamba_checkpoints:
            return self.mamba_slot_misses
        return self.decode_retractions if self.miss_at == "decode" else self.unwinds

    @property
    def recovery(self) -> str:
        if self.mamba_checkpoints:
            return "recovered Mamba slot misses"
        return "retracted after a decode miss" if self.miss_at == "decode" else "unwound"

    def metrics_disagreements(self) -> list[str]:
        """Where the server's /metrics and the hook count the same events differently."""
        hook_counts = {
            "unwinds": self.unwinds,
            "decode_retractions": self.decode_retractions,
            "parked_chunk_releases": self.parked_chunk_releases,
            "mamba_slot_misses": self.mamba_slot_misses,
        }
        return metrics.disagreements(self.scraped or {}, hook_counts, self.every_rank)


def read_counters(folder: Path) -> list[dict[str, Any]]:
    """The hook's counters, one record per process that wrote any."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def take_counters(run: Run, records: list[dict[str, Any]]) -> None:
    for record in records:
        rank = str(record.get("rank", 0))
        run.misses[rank] = run.misses.get(rank, 0) + int(record.get("injected_misses", 0))
        run.unwinds[rank] = run.unwinds.get(rank, 0) + int(record.get("unwinds", 0))
        retractions = int(record.get("decode_retractions", 0))
        run.decode_retractions[rank] = run.decode_retractions.get(rank, 0) + retractions
        released = int(record.get("parked_chunk_releases", 0))
        run.parked_chunk_releases[rank] = run.parked_chunk_releases.get(rank, 0) + released
        slot_misses = int(record.get("mamba_slot_misses", 0))
        run.mamba_slot_misses[rank] = run.mamba_slot_misses.get(rank, 0) + slot_misses
        run.decode_steps[rank] = run.decode_steps.get(rank, 0) + int(record.get("decode_steps", 0))
        run.decode_votes[rank] = run.decode_votes.get(rank, 0) + int(record.get("decode_votes", 0))
        run.iterations[rank] = run.iterations.get(rank, 0) + int(record.get("iterations", 0))
        idle = int(record.get("idle_round_all_reduces", 0))
        run.idle_round_all_reduces[rank] = run.idle_round_all_reduces.get(rank, 0) + idle
        withheld = int(record.get("withheld_readings", 0))
        run.withheld_readings[rank] = run.withheld_readings.get(rank, 0) + withheld
        amounts = int(record.get("withheld_amounts", 0))
        run.withheld_amounts[rank] = max(run.withheld_amounts.get(rank, 0), amounts)
        run.loads_started += int(record.get("loads_started", 0))
        run.mamba_loads += int(record.get("mamba_copies_landed", 0))
        run.mamba_late_copies += int(record.get("mamba_late_copies", 0))
        if run.l3_storage:
            run.prefetches[rank] = run.prefetches.get(rank, 0) + int(record.get("prefetches_started", 0))
            checks = int(record.get("prefetch_termination_checks", 0))
            run.prefetch_termination_checks[rank] = run.prefetch_termination_checks.get(rank, 0) + checks
        for rid, times in (record.get("unwound_rids") or {}).items():
            run.unwound_requests[rid] = max(run.unwound_requests.get(rid, 0), int(times))
        died = record.get("died_with")
        if died:
            run.died_with[rank] = f"{died['type']}: {died['message'].strip()} (raised in {died['raised_in']})"


def died_of_allocation(run: Run, injected: bool) -> list[str]:
    """The ranks whose scheduler's own exception was raised in sglang's prefill allocation code
    (and, where the misses are injected, that had one injected); in a run of Mamba checkpoint
    misses, the ranks that died of the Mamba checkpoint's assertion."""
    code = MAMBA_CHECKPOINT_ASSERTION if run.mamba_checkpoints else ALLOCATION_CODE
    return sorted(
        rank
        for rank, error in run.died_with.items()
        if code.search(error) and (run.misses.get(rank, 0) > 0 or not injected)
    )


def per_rank(counts: dict[str, int]) -> str:
    return " ".join(f"{rank}:{n}" for rank, n in sorted(counts.items())) or "-"


def voted_on_every_decode_step(run: Run) -> bool:
    """A rank-local run of the patched wheel with nothing injected whose ranks voted on their
    decode steps' allocations as often as they decoded: no step ran on the decode credit. (With
    nothing injected the hook gives the pool kvcached's reading of what no co-tenant can take, so
    the credit holds.)"""
    return (
        run.kind == CONTROL
        and run.rank_local
        and any(run.decode_votes.get(rank, 0) >= run.decode_steps.get(rank, 0) for rank in run.every_rank)
    )


def agreed_in_iterations_that_admitted_nothing(run: Run) -> bool:
    """A rank-local control run whose ranks made agreement all-reduces (decode votes aside) in loop
    iterations that admitted nothing with nothing queued: no rank could admit there, and the
    carried scheduler makes none."""
    return run.kind == CONTROL and run.rank_local and any(run.idle_round_all_reduces.values())


def decode_votes(run: Run) -> str:
    """A rank-local run's decode steps and the ranks' votes on them, and its loop iterations with
    the all-reduces made in those that admitted nothing, per rank (empty
    otherwise)."""
    if not run.rank_local:
        return ""
    return (
        f"; decode steps {per_rank(run.decode_steps)}, decode votes {per_rank(run.decode_votes)}"
        f"; iterations {per_rank(run.iterations)}, all-reduces in iterations that admitted nothing"
        " with nothing queued"
        f" {per_rank(run.idle_round_all_reduces)}"
    )


def complete(
    control: dict[str, list[int]] | None, scenario: Scenario = HICACHE
) -> TypeGuard[dict[str, list[int]]]:
    """A control run to compare with: it answered every request of the traffic."""
    return control is not None and set(control) == scenario.keys()


def judge(
    run: Run, outcomes: list[Outcome], control: dict[str, list[int]] | None, scenario: Scenario = HICACHE
) -> None:
    """Set run.verdict / run.ok from what the run showed, against its kind's expectation."""
    run.finished = sum(o.ok for o in outcomes)
    run.failed = len(outcomes) - run.finished
    run.host_cached_tokens = sum(o.host_cached for o in outcomes)
    run.storage_cached_tokens = sum(o.storage_cached for o in outcomes)
    everything = run.failed == 0 and run.started
    if complete(control, scenario) and everything:
        differing_keys = [o.key for o in outcomes if o.output_ids != control.get(o.key)]
        run.differing_requests = {key: run.unwound_requests.get(key, 0) for key in differing_keys}
        run.outputs_differing = len(differing_keys)
        run.outputs_equal_control = run.outputs_differing == 0
    every_rank = run.every_rank
    unwound_everywhere = all(run.recoveries.get(rank, 0) > 0 for rank in every_rank)
    prefetches_checked_everywhere = all(run.prefetch_termination_checks.get(rank, 0) for rank in every_rank)
    if not run.started and run.port_taken:
        run.ok, run.verdict = False, "the server could not bind its HTTP port (taken since it was chosen)"
    elif not run.started:
        run.ok, run.verdict = False, "the server never became healthy"
    elif run.checker_must_fire:
        run.ok = run.rank_divergence_found
        run.verdict = (
            "upstream's rank-consensus checker found rank divergence (as expected: the ranks' free"
            " space differs)"
            if run.ok
            else f"upstream's rank-consensus checker found no rank divergence ({run.finished} finished,"
            f" {run.failed} failed, server died: {run.server_died})"
        )
        run.checker_outrun = not run.ok and run.server_died
    elif run.rank_divergence_found and run.kind != PRISTINE:
        run.ok, run.verdict = False, "upstream's rank-consensus checker found rank divergence (server log)"
    elif scenario.injects and run.kind in INJECTING and run.injected_misses == 0:
        run.ok, run.verdict = (
            False,
            (
                "no miss was injected (no decode step of two requests or more)"
                if run.miss_at == "decode"
                else "no miss was injected (no load in flight at an allocation)"
            ),
        )
    elif run.withheld_tokens > 0 and not any(run.withheld_readings.values()):
        run.ok, run.verdict = False, "nothing was withheld (no reading of the free space was reduced)"
    elif run.withheld_drift and max(run.withheld_amounts.values(), default=0) < 2:
        run.ok, run.verdict = False, "the withheld reading did not drift (one amount withheld throughout)"
    elif everything and run.l3_storage and not (prefetches_checked_everywhere and run.storage_cached_tokens):
        run.ok, run.verdict = (
            False,
            f"no L3 prefetch was checked in flight on every rank, or none was read (prefetches"
            f" {run.prefetches}, termination checks {run.prefetch_termination_checks},"
            f" {run.storage_cached_tokens} prompt tokens read from L3)",
        )
    elif run.kind in COMPARING and not complete(control, scenario):
        run.ok, run.verdict = False, "no complete control run to compare the outputs with"
    elif run.hung:
        run.ok, run.verdict = (
            False,
            f"HANG: {sum(map(timed_out, outcomes))} request(s) timed out, server alive",
        )
    elif everything and voted_on_every_decode_step(run):
        run.ok, run.verdict = False, "no decode step ran on the decode credit" + decode_votes(run)
    elif everything and agreed_in_iterations_that_admitted_nothing(run):
        run.ok, run.verdict = False, "agreed in iterations that admitted nothing" + decode_votes(run)
    elif run.kind == CONTROL and not scenario.control_loads_from_host:
        # The reference of a natural run: its pool never missed, so nothing was put back.
        missed = any(run.unwinds.values()) or any(run.mamba_slot_misses.values())
        run.ok = everything and not missed and not run.died_with
        run.verdict = (
            "all requests finished, no miss" + decode_votes(run)
            if run.ok
            else f"{run.failed} failed, unwinds {run.unwinds}, Mamba slot misses {run.mamba_slot_misses},"
            f" died with {run.died_with or 'nothing'}"
        )
    elif run.kind == CONTROL:
        mamba_loaded = run.mamba_loads > 0 or not scenario.mamba_state
        run.ok = bool(
            everything
            and run.host_cached_tokens > 0
            and run.loads_started > 0
            and mamba_loaded
            and not run.died_with
        )
        run.verdict = (
            f"all requests finished, host hits seen{', Mamba states loaded' if scenario.mamba_state else ''}"
            + decode_votes(run)
            if run.ok
            else f"{run.failed} failed, host-cached tokens {run.host_cached_tokens},"
            f" loads {run.loads_started}, Mamba loads {run.mamba_loads},"
            f" died with {run.died_with or 'nothing'}"
        )
    elif run.kind == RECOMPUTE:
        run.ok = bool(everything and run.outputs_equal_control and not run.died_with)
        run.verdict = (
            "every output equals the control run's"
            if run.ok
            else f"{run.failed} failed, outputs equal control: {run.outputs_equal_control}"
            f" ({run.outputs_differing} differ), died with {run.died_with or 'nothing'}"
        )
    elif run.kind == PRISTINE:
        if run.server_died or run.failed or run.died_with:
            ranks = died_of_allocation(run, scenario.injects)
            run.ok = bool(ranks)
            error = "the Mamba checkpoint's assertion" if run.mamba_checkpoints else "the allocation error"
            run.verdict = (
                f"the scheduler died with {error} (as expected; rank {', '.join(ranks)})"
                if run.ok
                else f"the server died, but no scheduler of {error} ({run.died_with or 'no error recorded'})"
            )
        elif scenario.injects:
            run.ok = True
            run.verdict = "UPSTREAM FIXED IT: pristine survived the injected misses (drop the unwind entries)"
        else:
            # The traffic did not bring the miss about this time (or upstream fixed it): the run
            # showed nothing, so it cannot pass.
            run.ok, run.verdict = False, "no natural miss this time: pristine survived its traffic"
            run.natural_miss_absent = True
    elif (
        run.kind == PATCHED
        and scenario.parks_a_chunk
        and everything
        and not all(run.parked_chunk_releases.get(rank, 0) for rank in every_rank)
    ):
        # Every request was served, but the traffic never parked a chunk behind the last decoding
        # request: the run showed nothing of what it is for. (Released on some ranks only is a
        # divergence, not an absent miss.)
        run.ok, run.verdict = (
            False,
            f"no parked chunk was released this time (releases {run.parked_chunk_releases},"
            f" unwinds {run.unwinds})",
        )
        run.natural_miss_absent = not any(run.parked_chunk_releases.values())
    elif (
        run.kind == PATCHED
        and not scenario.injects
        and everything
        and not run.died_with
        and not any(run.recoveries.values())
    ):
        # Every request served and no rank missed: the traffic did not bring the miss about.
        run.ok, run.verdict = False, f"no natural miss this time: no rank {run.recovery}"
        run.natural_miss_absent = True
    elif run.kind == PATCHED:
        # What an operator sees must be what happened: the series' counters in the server's own
        # /metrics, equal to the hook's count of the same events on every rank.
        metrics_wrong = (
            "the server's /metrics could not be read after the traffic"
            if run.scraped is None
            else "; ".join(f"/metrics disagrees with the hook: {d}" for d in run.metrics_disagreements())
        )
        run.ok = bool(
            everything
            and unwound_everywhere
            and run.outputs_equal_control
            and not run.died_with
            and run.mamba_late_copies == 0
            and not metrics_wrong
        )
        differ = run.outputs_differing
        each = f" ({differ} differ, each with its unwinds: {run.differing_requests})" if differ else ""
        run.verdict = (
            f"every request finished, every rank {run.recovery}, outputs equal the control run's"
            + (
                f"; L3 prefetches {run.prefetches}, their termination checks"
                f" {run.prefetch_termination_checks}, {run.storage_cached_tokens} prompt tokens read from L3"
                if run.l3_storage
                else ""
            )
            + (f"; parked chunks released {run.parked_chunk_releases}" if scenario.parks_a_chunk else "")
            + f"; /metrics: {metrics.shown(run.scraped or {})}"
            if run.ok
            else (
                f"{run.failed} failed, misses {run.misses}, {run.recovery}: {run.recoveries},"
                f" outputs equal control: {run.outputs_equal_control}"
                f"{each}, Mamba copies landed after their slot's release: {run.mamba_late_copies},"
                f" died with {run.died_with or 'nothing'}" + (f"; {metrics_wrong}" if metrics_wrong else "")
            )
        )
    else:
        differing = run.outputs_differing or 0
        run.ok = bool(everything and unwound_everywhere and differing > 0 and not run.died_with)
        run.verdict = (
            f"the hazard showed: {differing} of {len(outcomes)} outputs differ from the control run's"
            + (
                f"; {run.mamba_late_copies} Mamba copies landed after their slot's release"
                if scenario.mamba_state
                else ""
            )
            if run.ok
            else (
                "the missing wait went unseen: outputs equal the control run's"
                if everything and unwound_everywhere and differing == 0
                else f"{run.failed} failed, misses {run.misses}, unwinds {run.unwinds},"
                f" died with {run.died_with or 'nothing'}"
            )
        )
