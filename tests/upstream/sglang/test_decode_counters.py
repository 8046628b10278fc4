"""What an operator sees of the series' decode entries (series entry "Scheduler: the decode
counters in Prometheus, every per-event line rate-limited"): each event of 0006 (a decode
allocation miss), 0014 (a wait for the host backups in flight before a retraction, and how long
it took) and 0015 (a parked chunk released) increments a counter of the scheduler's real
SchedulerMetricsCollector (its Prometheus classes swapped for recording stand-ins), and their log
lines, like the prefill unwind's, come at most one per 10 s with the count since the last one.

Expected: every test FAILS without the entry (no such metric; a line per event) and PASSES with it.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import scheduler_harness as sh
from sglang.srt.managers import scheduler as scheduler_module
from test_decode_agreement import _decode_step as decode_step_of_agreement
from test_decode_agreement import _lose_memory_for_one_step, _prefilled_batch
from test_decode_retraction import KV_TOKENS, _fill_with_a_finished_prefix, _start_decoding
from test_decode_retraction import _decode_step as decode_step_of_retraction
from test_parked_chunk_release import _decode_step as decode_step_of_parked
from test_parked_chunk_release import _parked_chunk_behind


def _decode_miss(h: sh.Harness) -> dict[str, Any]:
    batch = _prefilled_batch(h, 5)
    _lose_memory_for_one_step(h, batch)
    return decode_step_of_agreement(h, batch)


def test_a_decode_allocation_miss_is_counted_in_prometheus() -> None:
    with sh.build_harness(elastic=True) as h:
        metrics = h.enable_metrics()
        step = _decode_miss(h)
    assert step["misses"] == 1 and step["retracted"]
    assert metrics["sglang:num_decode_allocation_misses_total"].total == 1


def test_a_wait_for_the_host_backups_before_a_retraction_is_counted_and_timed() -> None:
    with sh.build_harness(hicache=True, auto_complete_events=False, kv_tokens=KV_TOKENS) as h:
        metrics = h.enable_metrics()
        batch = _start_decoding(h)
        _fill_with_a_finished_prefix(h)
        step = decode_step_of_retraction(h, batch)
        waits = h.scheduler.num_host_backup_waits_before_retraction
    assert step["retracted"] == [] and waits == 1
    assert metrics["sglang:num_host_backup_waits_before_retraction_total"].total == 1
    assert metrics["sglang:host_backup_wait_before_retraction_seconds"].total > 0


def test_a_parked_chunk_release_is_counted_in_prometheus() -> None:
    with _parked_chunk_behind(requests=1) as (h, batch, long):
        metrics = h.enable_metrics()
        step = decode_step_of_parked(h, batch, long)
    assert step["releases"] == 1
    assert metrics["sglang:num_parked_chunk_releases_total"].total == 1


def test_a_report_is_one_line_per_interval_with_the_count_since_the_last() -> None:
    report = scheduler_module.RateLimitedReport()
    interval = scheduler_module.PREFILL_UNWIND_LOG_INTERVAL_S
    moments = [100.0, 101.0, 100.0 + interval - 0.5, 100.0 + interval + 1, 100.0 + interval + 2]
    with mock.patch.object(scheduler_module.time, "monotonic", side_effect=moments):
        assert [report.due() for _ in moments] == [1, 0, 0, 3, 0]


def test_decode_misses_in_a_row_log_one_line_with_their_count() -> None:
    """Two decode steps that miss within 10 s: one warning, then the second is only counted;
    the line carries how many since the last one."""
    warns = mock.patch.object(scheduler_module.logger, "warning")
    with sh.build_harness(elastic=True) as h, warns as warning:
        _decode_miss(h)
        first = [c for c in warning.call_args_list if "decode step's allocation missed" in c.args[0]]
        h.scheduler.waiting_queue.clear()
        batch = h.scheduler.running_batch
        _lose_memory_for_one_step(h, batch)
        decode_step_of_agreement(h, batch)
        misses = h.scheduler.num_decode_allocation_misses
    lines = [c for c in warning.call_args_list if "decode step's allocation missed" in c.args[0]]
    assert misses == 2 and len(first) == 1 and len(lines) == 1
    assert "since the last report" in lines[0].args[0]


def test_diverged_rounds_in_a_row_log_one_error_line_with_their_count() -> None:
    """Two diverged rounds within 10 s: one error line, then the second is only counted."""
    errors = mock.patch.object(scheduler_module.logger, "error")
    with sh.build_harness() as h, errors as error:
        sched = h.scheduler
        for _ in range(2):
            sched._note_prefill_divergence(None, scheduler_module.PrefillRound.DIVERGED)
        diverged = sched.num_prefill_divergences
    lines = [c for c in error.call_args_list if "admitted different prefill batches" in c.args[1]]
    assert diverged == 2 and len(lines) == 1
    assert "since the last report" in lines[0].args[0]


def test_each_kind_of_event_has_its_own_report() -> None:
    """A decode miss reported a moment ago does not silence a parked chunk's release: each kind of
    event is rate-limited on its own."""
    warns = mock.patch.object(scheduler_module.logger, "warning")
    with _parked_chunk_behind(requests=1) as (h, batch, long), warns as warning:
        assert h.scheduler._report("decode_allocation_miss").due() == 1
        decode_step_of_parked(h, batch, long)
    lines = [c for c in warning.call_args_list if "Released the parked chunked request" in c.args[0]]
    assert len(lines) == 1
