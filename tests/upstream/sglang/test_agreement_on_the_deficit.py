"""The ranks agree through one RankAgreement, on the deficit (series entry "Scheduler: the ranks
agree through one RankAgreement, on each pool's deficit, and count the decode credit in tokens",
sgl-project/sglang#34676).

Before the entry the ledger was agreed on the least real reading and held only while every rank
had allocated alike: a round put back, a decode miss or the scheduler going idle on one rank made
the next round agree afresh before admission, an all-reduce that a rank idle on its own (its
HiCache state is rank-local) made alone, so the ranks' collectives parted. The entry agrees on
each pool's deficit (uniform minus real reading), which a rank's own allocations do not move, at
every vote whatever its outcome: after the first round no agreement before admission is needed,
and going idle changes no agreed value. Two forked gloo ranks with distinct group objects where
two ranks take part; readings drift at every reading on each rank.

Expected: these tests FAIL without the entry (no rank_agreement module; the rounds after a
put-back and after going idle make a second collective; a rank idle alone makes it alone) and
PASS with it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
import simulation as sim
import torch
from event_loop_driver import EventLoopDriver
from test_event_loop_driver import LOOPS, _queue
from test_prefill_unwind import _prompt
from test_rank_agreement import TwoRanks, _drifting, run_two_ranks


def _ballot(**fields: Any) -> Any:
    from sglang.srt.mem_cache.rank_agreement import Ballot

    defaults: dict[str, Any] = {
        "missed": False,
        "fingerprint": 0,
        "batch_size": 0,
        "deficits": (0,),
        "guaranteed": 100,
    }
    return Ballot(**{**defaults, **fields})


def _verdict_of(*ballots: Any) -> Any:
    """What the all-reduce (MAX) of these ballots decodes to."""
    from sglang.srt.mem_cache.rank_agreement import Verdict

    reduced = ballots[0].encode()
    for ballot in ballots[1:]:
        reduced = torch.maximum(reduced, ballot.encode())
    first = ballots[0]
    return Verdict.decode(reduced, pools=len(first.deficits), credit=first.guaranteed is not None)


def test_the_ballot_reduces_to_the_groups_verdict() -> None:
    """Each field of the typed ballot reduces to what the group agrees: any miss, whether the
    fingerprints agree (and whether any rank had a batch), the largest batch, the largest deficit
    of each pool, the least guaranteed reading."""
    from sglang.srt.mem_cache.rank_agreement import PrefillRound

    alike = _verdict_of(
        _ballot(fingerprint=7 | 1 << 32, batch_size=3, deficits=(5, 0), guaranteed=40),
        _ballot(fingerprint=7 | 1 << 32, batch_size=3, deficits=(2, 9), guaranteed=25, missed=True),
    )
    assert alike.any_missed and alike.unanimous and alike.any_batch
    assert (alike.largest_batch, alike.deficits, alike.least_guaranteed) == (3, (5, 9), 25)
    assert alike.prefill_round() is PrefillRound.MISSED
    apart = _verdict_of(_ballot(fingerprint=7 | 1 << 32, batch_size=4), _ballot(batch_size=0))
    assert not apart.unanimous and apart.largest_batch == 4
    assert apart.prefill_round() is PrefillRound.DIVERGED
    idle = _verdict_of(_ballot(), _ballot())
    assert idle.prefill_round() is PrefillRound.IDLE and idle.any_batch is False
    no_credit = _verdict_of(_ballot(guaranteed=None, deficits=()))
    assert no_credit.least_guaranteed is None and no_credit.deficits == ()


def test_the_credit_counts_each_steps_own_rows_against_the_least_reading() -> None:
    """The credit agreed at a vote covers steps while their rows, a page each, fit the least
    guaranteed reading, at most DECODE_CREDIT_MAX_STEPS; idle on one rank ends it there."""
    from sglang.srt.mem_cache.rank_agreement import DECODE_CREDIT_MAX_STEPS, RankAgreement

    agreement = RankAgreement(lambda vote: None, [], guaranteed=lambda: 10, page_size=2)
    assert not agreement.covers_decode_step(1)  # no vote yet: no credit
    agreement.vote(agreement.ballot(missed=False, fingerprint=0, batch_size=0))
    # Two rows take 4 tokens, three 6: the 10 agreed cover both steps, and no step after them.
    assert [agreement.covers_decode_step(rows) for rows in (2, 3, 1)] == [True, True, False]
    agreement.vote(agreement.ballot(missed=False, fingerprint=0, batch_size=0))
    assert agreement.covers_decode_step(5) and not agreement.covers_decode_step(1)
    big = RankAgreement(lambda vote: None, [], guaranteed=lambda: 10**9)
    big.vote(big.ballot(missed=False, fingerprint=0, batch_size=0))
    assert (
        sum(big.covers_decode_step(1) for _ in range(DECODE_CREDIT_MAX_STEPS + 5)) == DECODE_CREDIT_MAX_STEPS
    )
    agreement.read_real_while_idle()
    assert not agreement.covers_decode_step(1)


def _admitting_round(h: sh.Harness, prompt: int, miss: sh.MissSite | None = None) -> list[str] | None:
    h.add_request(_prompt(prompt))
    with h.arm_miss(miss) if miss else contextlib.nullcontext():
        batch = h.run_round()
    rids = None if batch is None else [r.rid for r in batch.reqs]
    for req in [] if batch is None else batch.reqs:
        h.finish_request(req)
    h.prepare_next_round()
    return rids


def _put_back_then_idle(h: sh.Harness, rank: int) -> dict[str, Any]:
    """On the real loop (event_loop_normal), iterations that each admit a new request: one that
    runs, one put back where rank 0's allocation missed, one that runs, then the loop idles (its
    own on_idle), then one more. Each round after the first makes one collective, its vote (the
    put-back round also agrees on how long its requests have been missing); an idle iteration
    makes none."""
    driver = EventLoopDriver(h)
    made: list[sim.Collective] = []
    per_round: list[int] = []
    rounds: list[list[str] | None] = []
    idle_collectives: list[sim.Collective] = []
    rank_0_misses: sh.MissSite | None = "token_slots" if rank == 0 else None
    # Co-tenants hold memory (the drift) throughout: upstream's strict idle check would read that
    # as a leak, so it is off here.
    with sim.recording_collectives(made), sim.strict_idle_check_off():
        for prompt, miss in ((0, None), (1, rank_0_misses), (2, None), (3, None)):
            if prompt == 3:  # what is left of the earlier rounds runs, then the loop idles
                while not (driver.ran_on_idle and driver.is_idle()) and len(driver.iterations) < 20:
                    before = len(made)
                    ran = driver.step()
                    if ran.forward_mode is None:
                        idle_collectives.extend(made[before:])
            h.add_request(_prompt(prompt), max_new_tokens=1)
            before = len(made)
            with h.arm_miss(miss) if miss else contextlib.nullcontext():
                ran = driver.step()
            rounds.append(list(ran.rids) if ran.forward_mode is not None else None)
            per_round.append(len(made) - before)
    return {"rounds": rounds, "per_round": per_round, "idle_collectives": idle_collectives}


def _loop_idle_on_one_rank(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    """The same through the real event loop: a request runs to its end; then for three
    iterations rank 1 is not fully idle (its `is_fully_idle()` reads HiCache state of its own,
    which upstream says can differ between ranks), so only rank 0's `on_idle` does the idle work;
    then a second request runs. Every collective either rank makes is recorded."""
    driver: EventLoopDriver = LOOPS[loop][0](h)
    made: list[Any] = []
    failure = None
    try:
        # Co-tenants hold memory (the drift) throughout: upstream's strict idle check would read
        # that as a leak, so it is off here.
        with sim.recording_collectives(made), sim.strict_idle_check_off():
            first = _queue(h, 0, 6, max_new_tokens=3)
            driver.run_until(first.finished, max_iterations=20)
            busy = mock.patch.object(h.scheduler, "is_fully_idle", lambda: False)
            with busy if rank == 1 else contextlib.nullcontext():
                driver.run(3)
            second = _queue(h, 1, 6, max_new_tokens=3)
            driver.run_until(second.finished, max_iterations=20)
            driver.run_until_idle(max_iterations=10)
    except Exception as error:  # a rank's loop raised (gloo's size mismatch, say)
        failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return {
        "iterations": [(it.forward_mode, it.rids) for it in driver.iterations],
        "collectives": made,
        "failure": failure,
    }


def _first_step_after_a_lone_prefill(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    """Three requests prefill together with nothing running; the loop's next iteration merges
    them into its LOCAL running batch (self.running_batch is still empty) and decodes it. After
    the prefill rank 1 holds 1 token mapped and a co-tenant holds all its other memory, drifting
    at every reading; rank 0 holds plenty. The step needs 3 tokens: the credit (1 token, the least
    reading) does not cover it, so it votes, misses on rank 1 and both ranks retract alike. A
    credit counted from self.running_batch's rows (none) would cover it, and rank 1's allocation
    would miss alone in a step no rank voted on."""
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    prompts = [5, 6, 7]
    h.physical.hold_mapped(sum(prompts) + (60 if rank == 0 else 1))
    reqs = [_queue(h, i, length, max_new_tokens=4) for i, length in enumerate(prompts)]
    failure = None
    misses = -1
    try:
        with sim.strict_idle_check_off():
            first = driver.step()
            assert first.forward_mode == "EXTEND" and len(first.rids) == 3, first
            if rank == 1:
                h.physical.drift(_drifting(h.physical.uniform()))
            driver.step()
            misses = h.scheduler.num_decode_allocation_misses
            h.physical.take(0)  # the co-tenants leave: whatever was retracted runs
            driver.run_until(lambda: all(req.finished() for req in reqs), max_iterations=40)
    except Exception as error:  # a rank's loop raised (a miss in a step no rank voted on)
        failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return {
        "iterations": [(it.forward_mode, it.rids) for it in driver.iterations],
        "misses_at_the_first_step": misses,
        "failure": failure,
    }


def _start_an_iteration(h: sh.Harness) -> None:
    """What every event loop does first in an iteration: the real `Scheduler.ingest_requests`, at
    the event loop driver's request receiver, where nothing arrives (the driver must be built)."""
    h.scheduler.ingest_requests()


def _prefill_server_after_idle(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    """A PD prefill server's own loop (event_loop_normal_disagg_prefill or
    event_loop_overlap_disagg_prefill, chosen by upstream's dispatch_event_loop): each iteration
    starts in `ingest_requests`, takes the bootstrapped requests and admits through
    `get_new_batch_prefill`, never through `get_next_batch_to_run`. A request is prefilled and its
    KV sent (upstream's fake transfer backend) on both ranks; the server goes idle (on_idle: each
    pool reads its real free space); then rank 0's co-tenants hold memory, drifting at every
    reading, and a request arrives that the agreed ledger admits. Every rank must admit it by the
    ledger (rank 0's allocation may then miss, put back alike) until the co-tenants leave; read
    by each rank's own drifting reading, the ranks admit apart and part."""
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    made: list[Any] = []
    failure = None
    reqs = []
    try:
        with sim.recording_collectives(made), sim.strict_idle_check_off():
            reqs.append(h.add_request(_prompt(0, 40)))
            driver.run_until(lambda: reqs[0].finished(), max_iterations=20)
            driver.run_until_idle(max_iterations=10)
            if rank == 0:
                h.physical.drift(_drifting(h.physical.uniform() - 8))
            reqs.append(h.add_request(_prompt(1, 40)))
            driver.run(4)
            h.physical.take(0)  # the co-tenants leave
            driver.run_until(lambda: reqs[1].finished(), max_iterations=20)
            driver.run_until_idle(max_iterations=10)
    except Exception as error:  # a rank's scheduler stopping, or its loop stuck in a collective
        failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return {
        "iterations": [(it.forward_mode, it.rids) for it in driver.iterations],
        "collectives": made,
        "failure": failure,
        "finished": [req.rid for req in reqs if req.finished()],
        "divergences": h.scheduler.num_prefill_divergences,
        "leaks": driver.idle_leaks,
    }


SCENARIOS: dict[str, Any] = {
    "tp_put_back_then_idle": _put_back_then_idle,
    **{
        f"pd_prefill_server_after_idle_{loop}": functools.partial(_prefill_server_after_idle, loop=loop)
        for loop in LOOPS
    },
    **{
        f"loop_idle_on_one_rank_{loop}": functools.partial(_loop_idle_on_one_rank, loop=loop)
        for loop in LOOPS
    },
    **{
        f"loop_first_step_{loop}": functools.partial(_first_step_after_a_lone_prefill, loop=loop)
        for loop in LOOPS
    },
}
CONFIGS = {
    "tp_put_back_then_idle": LOOPS["normal"][1],
    **{f"pd_prefill_server_after_idle_{loop}": {**LOOPS[loop][1], "pd_prefill": True} for loop in LOOPS},
    **{f"loop_idle_on_one_rank_{loop}": LOOPS[loop][1] for loop in LOOPS},
    **{f"loop_first_step_{loop}": LOOPS[loop][1] for loop in LOOPS},
}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    return run_two_ranks(list(SCENARIOS), SCENARIOS, {}, CONFIGS)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_prefill_server_reads_the_ledger_again_after_it_was_idle(two_ranks: TwoRanks, loop: str) -> None:
    """The PD prefill loops' iterations after an idle one admit by the agreed ledger on every
    rank: the same batches and collectives on both, both requests prefilled and sent, no
    divergence, nothing leaked."""
    ranks = two_ranks.scenario(f"pd_prefill_server_after_idle_{loop}")
    assert ranks[0]["failure"] is None and ranks[1]["failure"] is None, ranks
    assert ranks[0]["iterations"] == ranks[1]["iterations"], ranks
    assert ranks[0]["collectives"] == ranks[1]["collectives"], ranks
    for rank, result in ranks.items():
        assert result["finished"] == ["r0", "r1"], (rank, result)
        assert result["divergences"] == 0 and result["leaks"] == [], (rank, result)


def test_an_iteration_reads_the_ledger_again_from_its_first_call() -> None:
    """After on_idle (each pool reads its real free space, for the leak check), the first call
    of every event loop's iteration, `ingest_requests`, hands the agreed ledger back, before any
    decision of the iteration; so does a vote."""
    with sh.build_harness(elastic=True, **LOOPS["normal"][1]) as h:
        EventLoopDriver(h)
        assert h.physical is not None
        allocator = h.token_to_kv_pool_allocator
        h.physical.take(100)  # co-tenants hold 100 tokens: the agreed deficit
        _admitting_round(h, 0)
        uniform = h.physical.uniform()
        assert allocator.available_size() == uniform - 100
        h.scheduler._release_agreed_free_space()
        h.physical.take(150)
        assert allocator.available_size() == uniform - 150  # the real reading, while idle
        _start_an_iteration(h)
        assert allocator.available_size() == uniform - 100
        agreement = h.scheduler._prefill_agreement
        agreement.read_real_while_idle()
        agreement.agree()
        assert allocator.available_size() == uniform - 150  # the new vote's deficit


def test_every_event_loop_starts_its_iteration_in_ingest_requests() -> None:
    """Where the ledger is handed back must be reached by every loop a scheduler can run: each
    `event_loop_*` of the Scheduler (normal, overlap, PD prefill and decode, PP, multiplexing)
    calls `ingest_requests`."""
    from sglang.srt.managers.scheduler import Scheduler

    loops = {name: getattr(Scheduler, name) for name in dir(Scheduler) if name.startswith("event_loop")}
    assert {"event_loop_normal", "event_loop_overlap", "event_loop_normal_disagg_prefill"} <= set(loops)
    missing = [name for name, loop in loops.items() if "self.ingest_requests(" not in inspect.getsource(loop)]
    assert missing == []


@pytest.mark.parametrize("loop", LOOPS)
def test_a_rank_idle_alone_in_the_real_loop_stays_in_step(two_ranks: TwoRanks, loop: str) -> None:
    ranks = two_ranks.scenario(f"loop_idle_on_one_rank_{loop}")
    assert ranks[0]["failure"] is None and ranks[1]["failure"] is None, ranks
    assert ranks[0]["collectives"] == ranks[1]["collectives"]
    assert ranks[0]["iterations"] == ranks[1]["iterations"]


@pytest.mark.parametrize("loop", LOOPS)
def test_the_credit_counts_the_rows_of_the_step_it_covers(two_ranks: TwoRanks, loop: str) -> None:
    ranks = two_ranks.scenario(f"loop_first_step_{loop}")
    assert ranks[0]["failure"] is None and ranks[1]["failure"] is None, ranks
    assert ranks[0] == ranks[1]
    assert ranks[0]["misses_at_the_first_step"] == 1  # voted, missed on rank 1, retracted alike


def test_after_the_first_round_each_round_makes_one_vote_put_back_or_idle(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_put_back_then_idle")
    assert ranks[0] == ranks[1]
    assert ranks[0]["rounds"][1] is None  # put back on both ranks
    # The first round agrees before admission, then votes; the put-back round votes and agrees
    # on how long its requests have been missing; every other round votes once; idle, none.
    assert ranks[0]["per_round"] == [2, 2, 1, 1] and ranks[0]["idle_collectives"] == []


def test_the_agreement_is_one_object_of_its_own_module() -> None:
    """The scheduler's agreement is a RankAgreement (mem_cache/rank_agreement.py): the reduce,
    the ledger and the credit in one object."""
    from sglang.srt.mem_cache.rank_agreement import RankAgreement

    with sh.build_harness(elastic=True) as h:
        assert isinstance(h.scheduler._prefill_agreement, RankAgreement)
