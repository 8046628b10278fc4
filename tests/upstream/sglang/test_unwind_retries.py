"""Bounded retries, the abort and the metrics of the prefill unwind (series entry "Scheduler:
bound the unwind's retries in time, abort the request past the deadline, count it",
sgl-project/sglang#34676).

A request whose prefill keeps missing is retried with a back-off that doubles (slept only when
nothing runs, so an idle engine does not give up on a co-tenant's transient spike within
milliseconds) until it has been backed off SGLANG_PREFILL_UNWIND_DEADLINE_S; then it is aborted as
a queued request is, holding nothing. The sleeps go to a fake clock. Single-process tests on the
real scheduler (scheduler_harness.py); a miss is a real pool whose alloc reports None.

Expected: these tests FAIL without the patch (a request that keeps missing is retried forever)
and PASS with it.
"""

from __future__ import annotations

import contextlib
import logging
from http import HTTPStatus
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from sglang.srt.environ import envs
from test_unwind_operations import MAMBA, SCHEDULER_LOGGER, _holds_nothing, _prompt

# Back-offs of 5, 10, 20 and 40 ms pass 50 ms: the fifth miss in a row aborts.
DEADLINE_S = 0.05


MISSES_TO_ABORT = 5


BACKOFFS_S = [0.005, 0.01, 0.02, 0.04]


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SCHEDULER_LOGGER and r.levelno == logging.WARNING and text in r.getMessage()
    ]


# --------------------------------------------------------------------------------------------
# Bounded retries: a request that keeps missing is aborted, and operators can see it
# --------------------------------------------------------------------------------------------
class FakeClock:
    """The scheduler's clock: its back-off sleeps are recorded instead of slept, and advance it;
    `advance` is time passing otherwise (decode steps)."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []
        self.now = 1000.0

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def deadline() -> Any:
    with envs.SGLANG_PREFILL_UNWIND_DEADLINE_S.override(DEADLINE_S):
        yield DEADLINE_S


def _fake_clock(h: sh.Harness) -> FakeClock:
    clock = FakeClock()
    h.scheduler._prefill_unwind_sleep = clock.sleep
    h.scheduler._prefill_unwind_clock = clock.monotonic
    return clock


def _abort_outputs(h: sh.Harness) -> list[Any]:
    return list(h.scheduler.ipc_channels.send_to_tokenizer.outputs)


def test_persistent_miss_aborts_the_request(deadline: float, caplog: pytest.LogCaptureFixture) -> None:
    """The head request misses every round. With nothing running, the scheduler backs off between
    attempts (5, 10, 20, 40 ms: doubling), and once the head has been backed off for the deadline
    it is aborted through the normal abort path (the client gets a 503 with the reason, through
    `send_abort_output`), holding nothing. The request behind it then runs. One warning line for
    the whole run of unwinds; every unwind and the abort are counted, also in Prometheus."""
    with sh.build_harness(**MAMBA) as h:
        metrics = h.enable_metrics()
        clock = _fake_clock(h)
        caplog.set_level(logging.WARNING, logger=SCHEDULER_LOGGER)
        head = h.add_request(_prompt(0))
        behind = h.add_request(_prompt(1))
        rounds = 0
        with (
            h.arm_miss("token_slots"),
            mock.patch.object(
                h.scheduler, "send_abort_output", wraps=h.scheduler.send_abort_output
            ) as send_abort_output,
        ):
            while head in h.scheduler.waiting_queue and rounds < 20:
                assert h.run_round() is None
                rounds += 1
        assert rounds == MISSES_TO_ABORT
        assert clock.sleeps == BACKOFFS_S and sum(clock.sleeps) >= deadline
        [abort] = _abort_outputs(h)
        assert send_abort_output.call_count == 1  # the path the Rust server also reads
        assert abort.rid == head.rid
        assert abort.finished_reason["status_code"] == HTTPStatus.SERVICE_UNAVAILABLE
        assert f"SGLANG_PREFILL_UNWIND_DEADLINE_S={deadline}" in abort.finished_reason["message"]
        assert _holds_nothing(head) and head.finished()
        assert h.scheduler.waiting_queue == [behind]
        assert h.scheduler.num_prefill_unwinds == rounds
        assert h.scheduler.num_prefill_unwind_aborts == 1
        assert metrics["sglang:num_prefill_unwinds_total"].total == rounds
        assert metrics["sglang:num_prefill_unwind_aborted_requests_total"].total == 1
        assert len(_warnings(caplog, "unwound")) == 1  # rate-limited
        assert len(_warnings(caplog, f"Aborting request {head.rid}")) == 1

        batch = h.run_round()  # nothing armed: the request behind runs, with a fresh count
        assert batch is not None and batch.reqs == [behind]
        assert behind.consecutive_prefill_unwinds == 0 and behind.prefill_unwind_backoff_s == 0.0
        h.finish_request(behind)
        h.prepare_next_round()
        assert h.idle_leak_report() == []


def test_the_bound_is_time_not_rounds(deadline: float) -> None:
    """A longer deadline takes more attempts, and the back-off stops doubling at its ceiling:
    with a 1 s deadline the head is retried until 1 s of back-off (capped at 250 ms) is spent."""
    with envs.SGLANG_PREFILL_UNWIND_DEADLINE_S.override(1.0), sh.build_harness() as h:
        clock = _fake_clock(h)
        head = h.add_request(_prompt(0))
        with h.arm_miss("token_slots"):
            for _ in range(50):
                if head not in h.scheduler.waiting_queue:
                    break
                assert h.run_round() is None
        assert [a.rid for a in _abort_outputs(h)] == [head.rid]
        assert max(clock.sleeps) == 0.25 and 1.0 <= sum(clock.sleeps) < 1.25
        assert len(clock.sleeps) == 9  # 5 ... 160 ms, then 250 ms three times


def _miss_while_a_request_runs(
    h: sh.Harness, clock: FakeClock, miss: bool, round_s: float
) -> tuple[Any, Any, list[float]]:
    """A request runs; the next one (the head) is retried, missing here where `miss`, until it
    leaves the queue (at most 20 attempts), each attempt `round_s` after the last. Returns the
    running request, the head and the time the head had been missing at each attempt."""
    running = h.add_request(_prompt(0))
    batch = h.run_round()
    assert batch is not None
    h.scheduler.running_batch = batch
    head = h.add_request(_prompt(1))
    waited: list[float] = []
    with h.arm_miss("token_slots") if miss else contextlib.nullcontext():
        while head in h.scheduler.waiting_queue and len(waited) < 20:
            assert h.run_round() is None
            waited.append(head.prefill_unwind_backoff_s)
            clock.advance(round_s)
    return running, head, waited


def test_no_sleep_while_requests_run_and_the_deadline_is_wall_clock(deadline: float) -> None:
    """With requests running, their decode steps space the attempts: the scheduler does not
    sleep. The deadline is still time: with 20 ms between attempts, the head is aborted at the
    first attempt 50 ms after its first miss (the fourth), not after a count of misses."""
    with sh.build_harness(req_rows=8) as h:
        clock = _fake_clock(h)
        running, head, waited = _miss_while_a_request_runs(h, clock, miss=True, round_s=0.02)
        assert clock.sleeps == []
        assert waited == pytest.approx([0.0, 0.02, 0.04, 0.06])
        assert [a.rid for a in _abort_outputs(h)] == [head.rid]
        assert not running.finished()


def test_the_round_after_a_prefill_on_an_idle_engine_does_not_sleep(deadline: float) -> None:
    """On an idle engine a prefill batch runs; the next round's running batch is that batch,
    merged in by get_next_batch_to_run (scheduler.running_batch is still the empty one until the
    round ends). A miss in that round must not sleep: the just-prefilled requests are waiting."""
    with sh.build_harness(req_rows=8) as h:
        clock = _fake_clock(h)
        h.add_request(_prompt(0))
        prefilled = h.run_round()
        assert prefilled is not None and h.scheduler.running_batch.is_empty()
        head = h.add_request(_prompt(1))
        with h.arm_miss("token_slots"):
            plan = h.scheduler.get_new_batch_prefill(prefilled)
        assert plan.batch_to_run is None and head in h.scheduler.waiting_queue
        assert clock.sleeps == []


@pytest.mark.parametrize("config", [MAMBA, {}], ids=["mamba", "no-mamba"])
def test_persistent_miss_aborts_a_continuing_chunked_request(deadline: float, config: dict[str, Any]) -> None:
    """A continuing chunked request is admitted before the back-off cap, so without a bound its
    next chunk would be retried forever. Past the deadline it is aborted and gives back its row,
    the KV of its earlier chunks, its lock and (with Mamba) its Mamba slot: each on its own, so
    a request without a Mamba slot is released as fully."""
    with sh.build_harness(**config, chunked_prefill_size=64) as h:
        _fake_clock(h)
        long = h.add_request(_prompt(0, 200))
        first = h.run_round()
        assert first is not None and h.scheduler.chunked_req is long
        h.prepare_next_round()
        rounds = 0
        with h.arm_miss("token_slots"):
            while h.scheduler.chunked_req is long and rounds < 20:
                assert h.run_round() is None
                rounds += 1
        assert rounds == MISSES_TO_ABORT
        assert [a.rid for a in _abort_outputs(h)] == [long.rid]
        assert _holds_nothing(long) and long.finished()
        assert h.scheduler.chunked_req is None and h.scheduler.waiting_queue == []
        h.prepare_next_round()
        assert h.tree_cache.protected_size() == 0
        assert h.idle_leak_report() == []


def test_a_round_that_allocates_resets_the_count(deadline: float) -> None:
    """Only unwinds in a row count: a request that ran in between starts again from zero."""
    with sh.build_harness() as h:
        _fake_clock(h)
        reqs = [h.add_request(_prompt(i)) for i in range(2)]
        with h.arm_miss("token_slots"):
            for _ in range(MISSES_TO_ABORT - 1):
                assert h.run_round() is None
        assert [r.consecutive_prefill_unwinds for r in reqs] == [MISSES_TO_ABORT - 1, 1]
        batch = h.run_round()
        assert batch is not None and batch.reqs == reqs[:1]
        assert reqs[0].consecutive_prefill_unwinds == 0 and reqs[0].prefill_unwind_backoff_s == 0.0
        assert _abort_outputs(h) == []


def test_an_abort_under_pd_disaggregation_releases_the_prefill_side() -> None:
    """On a PD-disaggregation prefill server, a request aborted after its retries is released
    as a queued one is (release_aborted_prefill_waiting_req): its KV sender is told, its
    metadata buffer goes back, and nothing else is held."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    with envs.SGLANG_PREFILL_UNWIND_DEADLINE_S.override(0.0), sh.build_harness() as h:
        sched = h.scheduler
        released: list[str] = []
        real = type(sched).release_aborted_prefill_waiting_req

        class Sender:
            def abort(self) -> None:
                released.append("sender")

        class MetadataBuffers:
            def free(self, index: int) -> None:
                released.append(f"metadata {index}")

        sched.req_to_metadata_buffer_idx_allocator = MetadataBuffers()
        sched.clear_pending_chunk_send = lambda req: released.append("chunk sends")
        req = h.add_request(_prompt(0))
        sched.disaggregation_mode = DisaggregationMode.PREFILL  # after queueing: no bootstrap
        req.disagg_kv_sender = Sender()
        req.metadata_buffer_index = 3
        with (
            mock.patch.object(
                type(sched), "release_aborted_prefill_waiting_req", autospec=True, side_effect=real
            ) as release,
            h.arm_miss("token_slots"),
        ):
            assert h.run_round() is None
        assert [call.args[1] for call in release.call_args_list] == [req]
        assert released == ["chunk sends", "sender", "metadata 3"]
        assert _holds_nothing(req) and req.finished()


def test_a_diverged_round_is_counted_as_a_divergence_not_as_a_miss() -> None:
    """Two ranks whose trees differ put two rounds back before the scheduler stops (the rank
    agreement's `tp_trees_differ`). Those rounds are exported as divergences
    (`sglang:num_prefill_divergences_total`) on both ranks; the unwind counter, documented as
    batches whose allocation missed, does not count them."""
    from test_rank_agreement import run_two_ranks

    ranks = run_two_ranks(["tp_trees_differ"]).scenario("tp_trees_differ")
    for r in ranks.values():
        assert r["unwinds"] == 0
        assert r["metrics"].get("sglang:num_prefill_divergences_total") == 2
        assert r["metrics"].get("sglang:num_prefill_unwinds_total") == 0


def _clocks_that_differ(h: sh.Harness, rank: int) -> dict[str, Any]:
    """A request runs; the next one misses on rank 1 at every attempt (put back on both ranks).
    Between attempts rank 0's clock advances 20 ms and rank 1's 25 ms (a rank's rounds take as
    long as they take on it): each rank measures a different time missing."""
    with envs.SGLANG_PREFILL_UNWIND_DEADLINE_S.override(DEADLINE_S):
        clock = _fake_clock(h)
        round_s = 0.02 if rank == 0 else 0.025
        running, _, waited = _miss_while_a_request_runs(h, clock, miss=rank == 1, round_s=round_s)
    return {"waited": waited, "aborted": [a.rid for a in _abort_outputs(h)], "running": running.finished()}


def test_ranks_whose_clocks_differ_abort_the_same_request_in_the_same_round() -> None:
    """The deadline is the longest time any rank measured (one all-reduce, MAX, on a missed
    round): both ranks abort the request in the round rank 1's clock passes 50 ms. Each on its
    own clock, rank 1 would abort it a round before rank 0 and the ranks' queues would split."""
    from test_rank_agreement import run_two_ranks

    name = "tp_clocks_differ"
    ranks = run_two_ranks([name], {name: _clocks_that_differ}, {}).scenario(name)
    assert ranks[0] == ranks[1]
    assert ranks[0]["waited"] == pytest.approx([0.0, 0.025, 0.05])
    assert ranks[0]["aborted"] != [] and ranks[0]["running"] is False
