"""The REAL sglang event loop iteration (`Scheduler.event_loop_normal`) on CPU, driven by
`event_loop_driver.EventLoopDriver` on the scheduler harness: requests go through
`get_next_batch_to_run` (admission, the merge of the last prefill batch into the running batch,
decode), `run_batch` (the model forward is the only fake: token 7 for every request) and
`process_batch_result` (finish, release, streaming) until every request finished, and the
scheduler's own idle check runs (`on_idle`).

Each on both loops a server runs (event_loop_normal, and event_loop_overlap, which processes each
batch's result one iteration later). On one rank: requests of different lengths, arriving in two
waves; and a prompt longer than a prefill chunk. On two forked gloo ranks with elastic
(rank-local) KV pools whose readings drift: the same requests, the same batches on both ranks in
every iteration.

`test_the_credit_counts_the_rows_of_the_batch_the_loop_merged` checks a reported bug of the
series: it fails without series entry "Scheduler: the decode credit counts the rows of the batch
the event loop merged" and passes with it (see its docstring).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import scheduler_harness as sh
from event_loop_driver import NEXT_TOKEN, EventLoopDriver, Iteration, OverlapEventLoopDriver, check_tree
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from test_prefill_unwind import _prompt
from test_rank_agreement import TwoRanks, _drifting, agrees_by_deficit, run_two_ranks

NO_OVERLAP: dict[str, Any] = {"enable_overlap": False}  # event_loop_normal's mode
# Each loop a server runs: its driver and the harness flags of its mode (--disable-overlap-schedule
# for event_loop_normal; overlap, the default, for event_loop_overlap).
LOOPS: dict[str, tuple[type[EventLoopDriver], dict[str, Any]]] = {
    "normal": (EventLoopDriver, NO_OVERLAP),
    "overlap": (OverlapEventLoopDriver, {"enable_overlap": True}),
}
# The iterations a loop runs once its last batch ran: none of them has a batch; the overlap loop
# processes the last batch's result in the first, and runs on_idle in the second.
IDLE_TAIL = {"normal": [(None, ())], "overlap": [(None, ()), (None, ())]}


def _extra_decodes(driver: EventLoopDriver) -> int:
    """The decode steps the loop runs past the last token: one on the overlap loop of a tree that
    does not skip a finishing request's decode (0.5.20-0.5.21), its token thrown away."""
    return int(isinstance(driver, OverlapEventLoopDriver) and not driver.skips_finishing_decode)


def _queue(h: sh.Harness, i: int, length: int, max_new_tokens: int) -> Req:
    """A request as the loop receives it: built as handle_generate_request does, then queued
    through the real `_add_request_to_queue`."""
    req = h.make_req(_prompt(i, length), rid=f"r{i}", max_new_tokens=max_new_tokens)
    h.scheduler._add_request_to_queue(req)
    return req


def _finished_with_length(reqs: list[Req], max_new_tokens: int) -> dict[str, Any]:
    """Each request's output and why it finished (compared across ranks, so plain values)."""
    return {
        req.rid: (
            list(req.output_ids),
            type(req.finished_reason).__name__,
            len(req.output_ids) == max_new_tokens,
        )
        for req in reqs
    }


def _fingerprints(iterations: list[Iteration]) -> list[tuple[str | None, tuple[str, ...]]]:
    return [(it.forward_mode, it.rids) for it in iterations]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_driver_replays_this_trees_loop(overlap: bool) -> None:
    """event_loop_normal and event_loop_overlap of the imported tree make the calls the drivers
    replay, in their order."""
    check_tree(overlap)


@pytest.mark.parametrize("loop", LOOPS)
def test_requests_of_different_lengths_finish_through_the_real_loop(loop: str) -> None:
    """Two requests, then two more once the first prefill ran: the loop merges the first prefill
    batch into the running batch while it admits the second, then decodes all four together until
    each has max_new_tokens; then no batch is left to run, and on_idle's strict leak check passes
    (it raises on a leak), as does the harness's. The overlap loop processes each batch's result
    one iteration later, after it launched the next batch."""
    max_new = 6
    driver_class, flags = LOOPS[loop]
    with sh.build_harness(**flags) as h:
        driver = driver_class(h)
        reqs = [_queue(h, 0, 5, max_new), _queue(h, 1, 17, max_new)]
        driver.step()
        assert [len(req.output_ids) for req in reqs] == ([1, 1] if loop == "normal" else [0, 0])
        reqs += [_queue(h, 2, 40, max_new), _queue(h, 3, 64, max_new)]
        driver.run_until_idle(max_iterations=20)

        assert _fingerprints(driver.iterations) == [
            ("EXTEND", ("r0", "r1")),
            ("EXTEND", ("r2", "r3")),
            *[("DECODE", ("r0", "r1", "r2", "r3"))] * (max_new - 1 + _extra_decodes(driver)),
            *IDLE_TAIL[loop],
        ]
        assert [it.extend_tokens for it in driver.iterations[:2]] == [5 + 17, 40 + 64]
        for req in reqs:
            assert list(req.output_ids) == [NEXT_TOKEN] * max_new, req.rid
            assert isinstance(req.finished_reason, FINISH_LENGTH), req.rid
        assert len(driver.worker.forwards) == 2 + (max_new - 1) + _extra_decodes(driver)
        assert driver.detokenizer.outputs, "the result processor streamed nothing"
        assert h.scheduler.running_batch.is_empty() and h.scheduler.last_batch is None
        assert driver.idle_leaks == []


@pytest.mark.parametrize("loop", LOOPS)
def test_a_prompt_longer_than_a_chunk_runs_in_chunks_through_the_real_loop(loop: str) -> None:
    """chunked_prefill_size 16, a 40-token prompt and a 5-token one: the long prompt's prefill runs
    in 3 chunks of at most 16 tokens over 3 iterations (the short one joins the last chunk's
    batch), without output until its last chunk; then both decode to max_new_tokens."""
    max_new, chunk = 4, 16
    driver_class, flags = LOOPS[loop]
    with sh.build_harness(**flags, chunked_prefill_size=chunk) as h:
        driver = driver_class(h)
        long_req, short_req = _queue(h, 0, 40, max_new), _queue(h, 1, 5, max_new)
        outputs_per_iteration = []
        while not (long_req.finished() and short_req.finished()):
            assert len(driver.iterations) < 20, driver.iterations
            driver.step()
            outputs_per_iteration.append(len(long_req.output_ids))
        driver.run_until_idle(max_iterations=5)

        extends = [it for it in driver.iterations if it.forward_mode == "EXTEND"]
        assert [it.rids for it in extends] == [("r0",), ("r0",), ("r0", "r1")]
        assert [it.extend_tokens for it in extends] == [16, 16, 8 + 5]
        # No output before the last chunk ran (the overlap loop processes it one iteration later).
        assert outputs_per_iteration[:4] == ([0, 0, 1, 2] if loop == "normal" else [0, 0, 0, 1])
        decodes = max_new - 1 + _extra_decodes(driver)
        assert _fingerprints(driver.iterations[3:]) == [("DECODE", ("r0", "r1"))] * decodes + IDLE_TAIL[loop]
        for req in (long_req, short_req):
            assert list(req.output_ids) == [NEXT_TOKEN] * max_new, req.rid
        assert h.scheduler.chunked_req is None
        assert driver.idle_leaks == []


# --------------------------------------------------------------------------------------------
# Two ranks
# --------------------------------------------------------------------------------------------
WAVES = [[(0, 5), (1, 17)], [(2, 40), (3, 64)]]  # (prompt index, length), a wave per iteration
TWO_RANK_MAX_NEW = 6


def _two_waves_on_elastic_pools(h: sh.Harness, rank: int, loop: str = "normal") -> dict[str, Any]:
    """One rank: the requests of WAVES, the second wave queued after the first iteration; the loop
    runs until every request finished. The pools' real readings drift at every reading, differently
    on each rank (test_rank_agreement._drift_in_the_background). Then the co-tenants leave, so that
    the idle iteration's strict leak check compares the pools with their totals."""
    driver = LOOPS[loop][0](h)
    reqs: list[Req] = []
    for wave in WAVES:
        reqs += [_queue(h, i, length, TWO_RANK_MAX_NEW) for i, length in wave]
        driver.step()
    driver.run_until(lambda: all(req.finished() for req in reqs), max_iterations=30)
    assert h.physical is not None
    h.physical.take(0)
    driver.run_until_idle(max_iterations=5)
    return {
        "iterations": _fingerprints(driver.iterations),
        "finished": _finished_with_length(reqs, TWO_RANK_MAX_NEW),
        "decode_misses": h.scheduler.num_decode_allocation_misses,
        "unwinds": sh.num_prefill_unwinds(h),
        "leaks": driver.idle_leaks,
        "extra_decodes": _extra_decodes(driver),
    }


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    names = {f"loop_two_waves_{loop}": loop for loop in LOOPS}
    return run_two_ranks(
        list(names),
        {name: functools.partial(_two_waves_on_elastic_pools, loop=loop) for name, loop in names.items()},
        {},
        {name: LOOPS[loop][1] for name, loop in names.items()},
    )


@pytest.mark.parametrize("loop", LOOPS)
def test_two_ranks_run_the_same_batches_through_the_real_loop(two_ranks: TwoRanks, loop: str) -> None:
    ranks = two_ranks.scenario(f"loop_two_waves_{loop}")
    assert ranks[0]["iterations"] == ranks[1]["iterations"]
    assert ranks[0]["iterations"] == [
        ("EXTEND", ("r0", "r1")),
        ("EXTEND", ("r2", "r3")),
        *[("DECODE", ("r0", "r1", "r2", "r3"))] * (TWO_RANK_MAX_NEW - 1 + ranks[0]["extra_decodes"]),
        *IDLE_TAIL[loop],
    ]
    for rank, result in ranks.items():
        assert result["finished"] == {
            f"r{i}": ([NEXT_TOKEN] * TWO_RANK_MAX_NEW, "FINISH_LENGTH", True) for i in range(4)
        }, rank
        assert result["decode_misses"] == result["unwinds"] == 0, rank
        assert result["leaks"] == [], rank


# --------------------------------------------------------------------------------------------
# The decode credit of a round whose running batch the loop merged
# --------------------------------------------------------------------------------------------
CREDIT_MAX_NEW = 11  # after its prefill, a request decodes 10 steps
GUARANTEED = 10  # rank 1's tokens no co-tenant can take, after the second prefill's allocation
CREDIT_RUN = 12  # iterations: 2 prefills, then the 10 decode steps of both requests


def _record_rank_agreement(
    driver: Any, agreement: Any, agreed: list[dict[str, int]], credited: list[int]
) -> None:
    """RankAgreement: each vote's least guaranteed reading; each step its credit covered (counted
    against the rows of the step's own batch: no row bound, no batch read at the vote)."""
    real_vote, real_covers = agreement.vote, agreement.covers_decode_step

    def vote(ballot: Any) -> Any:
        verdict = real_vote(ballot)
        agreed.append({"iteration": len(driver.iterations) + 1, "least": verdict.least_guaranteed})
        return verdict

    def covers_decode_step(rows: int) -> bool:
        covered = bool(real_covers(rows))
        if covered:
            credited.append(len(driver.iterations) + 1)
        return covered

    agreement.vote, agreement.covers_decode_step = vote, covers_decode_step


def _record_decode_credit(
    driver: Any, agreement: Any, agreed: list[dict[str, int]], credited: list[int]
) -> None:
    """The series' first credit (DecodeCredit): each agreement's rows, least reading and steps."""
    assert agreement is not None and agreement.decode_credit is not None, "no decode credit"
    credit = agreement.decode_credit
    real_agree, real_take_step = credit.agree, credit.take_step

    def agree(reduced: Any) -> None:
        real_agree(reduced)
        rows, neg_least = reduced
        agreed.append(
            {
                "iteration": len(driver.iterations) + 1,
                "rows": rows,
                "least": -neg_least,
                "steps": credit._steps_left,
            }
        )

    def take_step() -> bool:
        taken = bool(real_take_step())
        if taken:
            credited.append(len(driver.iterations) + 1)
        return taken

    credit.agree, credit.take_step = agree, take_step


def _credit_after_a_merged_prefill(h: sh.Harness, rank: int) -> dict[str, Any]:
    """A runs its prefill alone (the running batch is empty). B arrives; the next iteration's
    `get_next_batch_to_run` makes A's prefill batch its LOCAL running batch (self.running_batch
    is still the empty batch: the loop assigns it after the plan returns) and admits B. That
    round's vote agrees the decode credit. Rank 1 then holds GUARANTEED tokens mapped after B's
    allocation (rank 0: more) and a co-tenant maps away everything else on rank 1, drifting at
    every reading. The decode steps of A and B take 2 tokens each: GUARANTEED covers 5 of them.

    Recorded: each credit agreement (rows, least reading, steps), each iteration's fingerprint
    and whether it ran on the credit, and an exception a rank's loop raised."""
    sched = h.scheduler
    driver = EventLoopDriver(h)
    agreement = sched._prefill_agreement
    agreed: list[dict[str, int]] = []
    credited: list[int] = []
    if agrees_by_deficit(sched):
        _record_rank_agreement(driver, agreement, agreed, credited)
    else:
        _record_decode_credit(driver, agreement, agreed, credited)
    assert h.physical is not None
    reqs = [_queue(h, 0, 5, CREDIT_MAX_NEW)]
    failure: dict[str, Any] | None = None
    decode_rows: list[int] = []
    try:
        driver.step()  # A's prefill
        h.physical.hold_mapped(60 if rank == 0 else GUARANTEED + 5)  # B allocates its 5 from it
        reqs.append(_queue(h, 1, 5, CREDIT_MAX_NEW))
        driver.step()  # B's prefill, A's batch merged into the loop's local running batch
        if rank == 1:
            h.physical.drift(_drifting(h.physical.uniform()))
        while len(driver.iterations) < CREDIT_RUN:
            it = driver.step()
            if it.forward_mode == "DECODE":
                decode_rows.append(len(it.rids))
        # The co-tenants leave: whatever was retracted runs, then the loop goes idle.
        h.physical.take(0)
        driver.run_until(lambda: all(req.finished() for req in reqs), max_iterations=40)
        driver.run_until_idle(max_iterations=5)
    except Exception as error:
        iteration = len(driver.iterations) + 1
        failure = {
            "iteration": iteration,
            "error": f"{type(error).__name__}: {str(error).splitlines()[0]}",
            "credited": iteration in credited,
        }
    return {
        "agreed": agreed,
        "credited": credited,
        "decode_rows": decode_rows,
        "iterations": _fingerprints(driver.iterations),
        "failure": failure,
        "finished": {req.rid: req.finished() for req in reqs},
    }


@pytest.fixture(scope="module")
def credit_ranks() -> TwoRanks:
    name = "loop_credit_after_merge"
    return run_two_ranks([name], {name: _credit_after_a_merged_prefill}, {}, {name: NO_OVERLAP})


def test_the_credit_counts_the_rows_of_the_batch_the_loop_merged(credit_ranks: TwoRanks) -> None:
    """Fails without series entry "Scheduler: the decode credit counts the rows of the batch the
    event loop merged" (the reported bug of "Scheduler: decode steps the ranks agreed no rank can
    miss run without a vote"): `_settle_prefill_round` built the credit's ballot from
    `self.running_batch` plus the round's batch, but `get_next_batch_to_run` passed
    `get_new_batch_prefill` a LOCAL running batch that holds the last prefill batch merged in; the
    loop assigns it to `self.running_batch` only after the round. So the round after A's prefill
    agreed a credit for 1 row where the next decode steps run 2: 10 steps on rank 1's 10 guaranteed
    tokens, which hold 5, and rank 1's allocation missed alone in a step no rank voted on (its loop
    raised AllocationMiss; rank 0 ran on). The entry's ballot counts the round's running batch
    (`_prefill_round_running_batch`)."""
    ranks = credit_ranks.scenario("loop_credit_after_merge")
    measured = {
        rank: {k: r[k] for k in ("agreed", "credited", "decode_rows", "failure")} for rank, r in ranks.items()
    }
    for rank, result in ranks.items():
        # The agreement the second prefill round made, and the rows of the steps it covers.
        after_merge = [a for a in result["agreed"] if a["iteration"] == 2]
        assert after_merge, (rank, measured)
        assert result["credited"], (rank, measured)  # the credit ran steps without a vote
        assert "rows" not in after_merge[0] or after_merge[0]["rows"] >= 2, (
            f"rank {rank}: the credit agreed for {after_merge[0]['rows']} row(s) and "
            f"{after_merge[0]['steps']} steps on {after_merge[0]['least']} guaranteed tokens; the loop's "
            f"next decode steps ran {result['decode_rows'][:1]} rows. Measured: {measured}"
        )
        assert result["failure"] is None, f"rank {rank}: {result['failure']}. Measured: {measured}"
    assert ranks[0]["iterations"] == ranks[1]["iterations"], measured
    assert all(ranks[0]["finished"].values()) and all(ranks[1]["finished"].values()), measured


def test_the_credit_counts_each_beam_of_a_beam_search_request_as_a_row() -> None:
    """A beam-search request decodes beam_width rows a step, each taking up to a page: a credit of
    3 tokens (page size 1) covers a step of one plain request, not one of a request with 4 beams,
    which votes instead."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    with sh.build_harness(elastic=True) as h:
        assert h.physical is not None
        h.physical.hold_mapped(3)
        sched = h.scheduler
        agreement = sched._prefill_agreement
        plain, beams = h.make_req(_prompt(0), rid="plain"), h.make_req(_prompt(1), rid="beams")
        beams.sampling_params.beam_width = 4
        agreement.vote(agreement.ballot(missed=False, fingerprint=0, batch_size=0))
        assert sched._decode_step_vote(ScheduleBatch(reqs=[beams])) is not None  # 4 rows > 3 tokens
        assert sched._decode_step_vote(ScheduleBatch(reqs=[plain])) is None  # credited
