"""The ranks of one group agree on each prefill round (series entry "Scheduler: the ranks of a
group agree on their free space and on each prefill round", sgl-project/sglang#34676).

With a pool whose free space is decided on each rank (kvcached's elastic pools: each GPU maps
memory on demand, shared with co-tenants) the ranks of one attention group would admit, evict and
size chunks differently, and a miss on one rank would leave the others running the batch. With
the patch such a pool says so (`rank_local_capacity`; composite pools answer for their parts);
the ranks agree on its free space before admission (carried by the previous round's vote where it
still holds), and after allocation on the round: run, put back everywhere, or a divergence that
is reported and, repeated, stops the scheduler. Two forked gloo ranks, with the TP, attention-TP
and attention-CP groups as distinct objects; single-process tests for the capability and the
collectives a round makes.

Expected: these tests FAIL with the single-rank unwind alone and PASS with the patch, except
`test_dp_attention_ranks_do_not_agree` and `test_a_kvcached_attribute_alone_turns_nothing_on`,
which pin what the patch must leave alone.
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
import types
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Literal, NamedTuple
from unittest import mock

import forked_ranks
import pytest
import scheduler_harness as sh
import torch
import torch.distributed as dist
from event_loop_driver import EventLoopDriver, OverlapEventLoopDriver
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.session.session_controller import Session
from simulation import strict_idle_check_off
from test_prefill_unwind import CHUNK, MAMBA, PING_PONG, PREFIX, _charged, _prompt, _start_chunked


def counted_alike(pool: Any) -> None:
    """Give one of sglang's own pools, declared rank-local by a test, the rank-local pool
    interface: its free list is its own calls' count, so its uniform reading is its real one, and
    the agreed deficit (0) changes nothing it reads."""
    pool.uniform_available_size = pool.available_size
    pool.real_available_size = pool.available_size
    pool.agree_deficit = lambda deficit: None


def agrees_by_deficit(sched: Any) -> bool:
    """The tree carries RankAgreement (the agreement on each pool's deficit, agreed by every vote
    whatever its outcome); before it the series agreed on the least free space (AgreedCapacity)."""
    return hasattr(sched._prefill_agreement, "reads_ledger")


def ballot_head_fields() -> int:
    """A RankAgreement ballot's fields before its deficits: whether it missed, the fingerprint
    twice, the batch size; from series entry 'ranks that meet in different votes stop alike' on,
    the vote's kind twice more."""
    from sglang.srt.mem_cache import rank_agreement

    return 6 if hasattr(rank_agreement, "VoteKind") else 4


def ballot_fields_per_pool() -> int:
    """A RankAgreement ballot's fields per rank-local pool: its deficit; from series entry 'the
    ranks agree on the least free space, not only the largest deficit' on, also what the rank had
    free before it allocated."""
    from sglang.srt.mem_cache import rank_agreement

    return 2 if "free_before" in rank_agreement.Ballot.__dataclass_fields__ else 1


def _reads_the_ledger(sched: Any) -> bool:
    """Whether the scheduler's pools read the agreed ledger now. The series' first agreement
    (AgreedCapacity) keeps it while `current`; from RankAgreement on (one object, agreed on the
    deficit) it holds from the first agreement on, except while the rank is idle."""
    agreement = sched._prefill_agreement
    capacity = getattr(agreement, "capacity", None)
    if capacity is not None:
        return bool(capacity.current)
    return bool(agreement.reads_ledger)


def _after_the_agreement_before_admission(
    sched: Any, stack: contextlib.ExitStack, then: Callable[[], None]
) -> bool:
    """Run `then` each time the ranks have agreed before a round's admission; False where the
    series agrees on nothing before admission. (From RankAgreement on, they agree before
    admission in the first round that has something to admit only.)"""
    agree = getattr(sched, "_agree_on_free_space", None)
    if agree is not None:

        def agree_then(agreement: Any) -> None:
            agree(agreement)
            then()

        stack.enter_context(mock.patch.object(sched, "_agree_on_free_space", agree_then))
        return True
    agreement = getattr(sched, "_prefill_agreement", None)
    if agreement is None or not hasattr(agreement, "agree"):
        return False
    agree_once = agreement.agree

    def agree_once_then() -> None:
        agree_once()
        then()

    stack.enter_context(mock.patch.object(agreement, "agree", agree_once_then))
    return True


# --------------------------------------------------------------------------------------------
# Two ranks over gloo, with the parallel groups as distinct objects
# --------------------------------------------------------------------------------------------
RANKS = 2


SCENARIO_ERROR = "error"  # a scenario that raised on a rank: its traceback
# Per scenario, whether upstream's rank-consensus checker found the ranks' decisions apart.
CONSENSUS = "rank consensus checker fired"
# Scenarios that make the ranks' trees differ on purpose (the series' safety net, DIVERGED, is what
# they test; test_diverged_round_loads.py's host trees, up to series entry 0021): the checker must
# find that divergence. (Where the ranks differ only in their extend ranges,
# tp_chunk_sizes_differ, or in what their own readings admit, test_rounds_that_admit_nothing, no
# @rank_consensus call differs: the series' vote finds it, upstream's checker does not.)
EXPECTED_DIVERGENCE = frozenset(
    {"tp_trees_differ", "tp_admitted_apart", "tp_diverged_round_loads_on_one_rank"}
)


RANK_TIMEOUT_S = 180  # join limit; the collectives themselves time out after 30 s


MISSING_RANK = 1


Topology = Literal["tp", "cp", "dp_attention"]


class RankScenario(NamedTuple):
    config: dict[str, Any]
    topology: Topology  # which group spans both ranks (see _groups)
    site: sh.MissSite | None  # armed on MISSING_RANK only
    # What the round's batch starts with ("session_first": a streaming session's first turn).
    first: Literal["fresh", "session", "session_first", "chunked", "host"]
    # From before the first round, a co-tenant maps rank 0's KV memory away (kvcached computes
    # free space per rank) until rank 0 has only this many free tokens: it would admit less.
    rank0_free_tokens: int | None = None


ELASTIC: dict[str, Any] = {"elastic": True}


# A scenario that drives one rank's harness through several rounds; what it returns is compared.
MultiRoundScenario = Callable[[sh.Harness, int], dict[str, Any]]


RANK_SCENARIOS = {
    "tp_mamba_ping_pong": RankScenario({**PING_PONG, **ELASTIC}, "tp", "token_slots", "fresh"),
    # page 4, a streaming-session turn on a 30-token prefix: its extend starts inside the
    # prefix's last page, which `give_back_extend` must not free on the rank that did not miss.
    "tp_paged_session": RankScenario({"page_size": 4, **ELASTIC}, "tp", "paged_extend", "session"),
    # A streaming session's first turn: its allocation hands the request's record and admission
    # lock to a new session slot, on the rank that did not miss.
    "tp_session_first_turn": RankScenario(ELASTIC, "tp", "token_slots", "session_first"),
    # A continuing chunked request with ping-pong tracking (its second chunk is unwound).
    "tp_chunked_ping_pong": RankScenario(
        {**PING_PONG, "chunked_prefill_size": CHUNK, **ELASTIC}, "tp", "token_slots", "chunked"
    ),
    # Context parallel: the attention-CP group spans the ranks, attention-TP is one rank each.
    "cp_mamba": RankScenario({**MAMBA, **ELASTIC}, "cp", "token_slots", "fresh"),
    # DP attention: each rank schedules its own batch; TP spans both ranks but must not agree.
    "dp_attention_mamba": RankScenario({**MAMBA, **ELASTIC}, "dp_attention", "token_slots", "fresh"),
    # No miss: rank 0's pool has less free space than rank 1's.
    "tp_skewed_free": RankScenario(ELASTIC, "tp", None, "fresh", rank0_free_tokens=40),
    # A host hit: the round starts a HiCache load on both ranks, rank 1 misses.
    "tp_hicache_host": RankScenario(
        {**MAMBA, **ELASTIC, "hicache": True, "auto_complete_events": False}, "tp", "token_slots", "host"
    ),
}


UNWIND_BOTH = [
    "tp_mamba_ping_pong",
    "tp_paged_session",
    "tp_session_first_turn",
    "tp_chunked_ping_pong",
    "cp_mamba",
]


def _req_state(req: Req) -> tuple[Any, ...]:
    """What a rank knows about a request, to compare ranks (pool indices may differ)."""
    kv = req.kv
    return (
        req.rid,
        kv.holds_kv,
        kv.holds_mamba,
        kv.kv_allocated_len,
        kv.kv_committed_len,
        req.cached_tokens,
        req.already_computed,
        req.extend_batch_idx,
        req.inflight_middle_chunks,
        kv.mamba_next_track_idx,
        kv.mamba_last_track_idx,
    )


def _release_order(entries: list[tuple[str, str]]) -> dict[str, Any]:
    """Where, in a rank's device log, it waited on a load and, once the load started, released a
    lock or a Mamba slot (admission's own releases come before the load starts)."""
    starts = [i for i, (op, name) in enumerate(entries) if op == "record" and name.startswith("load")]
    load_start = starts[0] if starts else len(entries)
    syncs = [i for i, (op, _) in enumerate(entries) if op == "synchronize"]
    releases = [
        i for i, (op, _) in enumerate(entries) if i > load_start and op in ("dec_lock_ref", "mamba_free")
    ]
    locks = [i for i in releases if entries[i][0] == "dec_lock_ref"]
    return {
        "synchronized": [entries[i][1] for i in syncs],
        "first_sync": syncs[0] if syncs else None,
        "first_release": releases[0] if releases else None,
        "first_lock_release": locks[0] if locks else None,
    }


def _no_miss() -> contextlib.nullcontext[list[str]]:
    """In place of `h.arm_miss` on a rank that misses nothing: no site is reported."""
    return contextlib.nullcontext([])


def _rank_scenario(h: sh.Harness, rank: int, scenario: RankScenario) -> dict[str, Any]:
    """The scenario on SGLang's real event loop (the one the scenario's configuration runs:
    event_loop_overlap, a server's default, unless it disables overlap): the round under test is
    one iteration of it, the retry the next; what the loop does between them (the chunk's stash,
    the HiCache events' poll, on_idle) is the loop's own."""
    sched = h.scheduler
    driver = (OverlapEventLoopDriver if h.cfg.enable_overlap else EventLoopDriver)(h)
    reqs: list[Req] = []
    if scenario.first == "session":
        first_turn = _prompt(7, 30)
        session = h.open_streaming_session(first_turn)
        reqs.append(h.add_request([*first_turn, 5, 6, 7, 8, 9], session=session))
    elif scenario.first == "session_first":
        session = Session(capacity_of_str_len=1 << 16, session_id="first-turn", streaming=True)
        reqs.append(h.add_request(_prompt(7, 30), session=session))
    elif scenario.first == "chunked":
        long = h.add_request(_prompt(0, 100))
        # Both ranks run its first chunk; the next iteration stashes it and continues it.
        assert driver.step().rids == (long.rid,) and sched.chunked_req is long
        reqs.append(long)
    elif scenario.first == "host":
        h.put_prefix_on_host(PREFIX)
        reqs.append(h.add_request([*PREFIX, 7, 8, 9]))
    reqs += [h.add_request(_prompt(i)) for i in range(4 - len(reqs))]
    h.device_log.clear()
    with contextlib.ExitStack() as stack:
        reported = stack.enter_context(
            h.arm_miss(scenario.site) if rank == MISSING_RANK and scenario.site else _no_miss()
        )
        stack.enter_context(h.spy_releases())
        before = stack.enter_context(_read_when_the_round_begins(h))
        round_ = driver.step()
    consumer = [int(name) for op, name in h.device_log.entries if op == "consumer"]
    protected_before = before["protected"]
    result: dict[str, Any] = {
        "batch": list(round_.rids) if round_.forward_mode is not None else None,
        "reported": list(reported),
        "before": before["free"],
        "after": h.free_counts(),
        "queue": [r.rid for r in sched.waiting_queue],
        "chunked": None if sched.chunked_req is None else sched.chunked_req.rid,
        "unwinds": sh.num_prefill_unwinds(h),
        "cap": sched.prefill_unwind_admit_cap,
        "protected": (protected_before, h.tree_cache.protected_size()),
        "state_after_unwind": [_req_state(r) for r in reqs],
        "order": _release_order(h.device_log.entries),
        "finish_event": (
            h.layer_done_counter.events[consumer[0]].finish_event.name
            if consumer and consumer[0] >= 0
            else None
        ),
    }
    result["session_slots"] = _session_slots(h)
    retry = driver.step()
    result["retry"] = list(retry.rids) if retry.forward_mode is not None else None
    result["session_slots_after_retry"] = _session_slots(h)
    result["state_after_retry"] = [_req_state(r) for r in reqs]
    if scenario.rank0_free_tokens is not None:
        if rank != 0 and h.physical is not None:
            # Rank 1's drifting co-tenants leave: its pool as it is then has no memory away, so
            # sglang's idle check can compare it with its total.
            h.physical.take(0)
        # Upstream's strict idle check off, as kvcached's integration runs it (rank 0's co-tenant
        # still holds its memory, which the check would read as a leak): the harness's check,
        # read on every idle iteration before and after the scheduler reads its pools as they are.
        idle_reports = _idle_reports_around_the_release(h)
        with strict_idle_check_off():
            driver.run_until_idle(max_iterations=60)
        agreed, released = idle_reports[-1] if idle_reports else (None, None)
        result["idle_leaks_agreed"], result["idle_leaks_released"] = agreed, released
    return result


@contextlib.contextmanager
def _read_when_the_round_begins(h: sh.Harness) -> Iterator[dict[str, Any]]:
    """The pools' own free counts and the tree's protected size as the loop's prefill round
    begins (after what the loop does first: a chunk's stash, the HiCache events' poll)."""
    sched = h.scheduler
    read: dict[str, Any] = {}
    get_new_batch_prefill = sched.get_new_batch_prefill

    def reading_first(*args: Any, **kwargs: Any) -> Any:
        if not read:
            read.update(free=h.free_counts(), protected=h.tree_cache.protected_size())
        return get_new_batch_prefill(*args, **kwargs)

    with mock.patch.object(sched, "get_new_batch_prefill", reading_first):
        yield read


def _idle_reports_around_the_release(h: sh.Harness) -> list[tuple[list[str], list[str]]]:
    """Each time the idle scheduler releases the agreed free space (on_idle's first step), the
    harness's leak report before and after it."""
    sched = h.scheduler
    reports: list[tuple[list[str], list[str]]] = []
    release = getattr(sched, "_release_agreed_free_space", None)
    if release is None:  # no agreement in this tree: nothing is released
        return [([], [])]

    def reported_around(*args: Any, **kwargs: Any) -> Any:
        if not sched.is_fully_idle():
            return release(*args, **kwargs)
        agreed = [str(leak) for leak in h.idle_leak_report()]
        released = release(*args, **kwargs)
        reports.append((agreed, [str(leak) for leak in h.idle_leak_report()]))
        return released

    sched._release_agreed_free_space = reported_around
    return reports


@contextlib.contextmanager
def _cotenant(h: sh.Harness, leave_free: int) -> Iterator[None]:
    """Another engine maps this rank's GPU memory away until `leave_free` tokens of its KV pool
    can still be mapped (what a kvcached co-tenant does to one GPU: the pool's own free list is
    untouched); it gives the memory back on exit (what co-tenants held before comes back)."""
    assert h.physical is not None, "a co-tenant needs an elastic pool"
    before = h.physical.taken
    h.physical.take(h.physical.uniform() - leave_free)
    try:
        yield
    finally:
        h.physical.taken = before


def _session_slots(h: sh.Harness) -> dict[str, bool] | None:
    """Each streaming session slot, by id: whether it holds a tree lock (None: no such cache)."""
    session_cache = getattr(h.tree_cache, "session", None)
    if session_cache is None:
        return None
    return {sid: _slot_holds_lock(slot) for sid, slot in session_cache.slots.items()}


def _slot_holds_lock(slot: Any) -> bool:
    """Up to 0.5.21 a slot keeps its first turn's tree node and lock receipt (`last_node`,
    `lock_receipt`); from 0.5.22 on the lock itself (`lock`)."""
    if hasattr(slot, "lock"):
        return slot.lock is not None
    return slot.last_node is not None


def _groups(topology: Topology, rank: int, world: Any, pair: Any, singles: list[Any]) -> dict[str, Any]:
    """The harness's groups for one rank: `pair` spans both ranks, `singles[rank]` is this rank
    alone, and the TP group is `world`, an object distinct from `pair`."""
    alone = singles[rank]
    if topology == "tp":
        return {"tp_cpu_group": world, "attn_tp_cpu_group": pair, "attn_cp_cpu_group": alone}
    if topology == "cp":
        return {"tp_cpu_group": world, "attn_tp_cpu_group": alone, "attn_cp_cpu_group": pair}
    return {
        "tp_cpu_group": world,
        "attn_tp_cpu_group": alone,
        "attn_cp_cpu_group": alone,
        "enable_dp_attention": True,
    }


def _drift_in_the_background(h: sh.Harness, rank: int) -> None:
    """Every multi-rank scenario's elastic pool: what co-tenants hold of this rank's GPU changes at
    every reading (kvcached's TTL-cached physical reading), a few tokens, differently on each
    rank, unless the scenario takes or drifts the memory itself."""
    if h.physical is not None:
        h.physical.drift(_drifting(rank))


def _rank_body(
    names: list[str],
    scenarios: Mapping[str, MultiRoundScenario],
    kv_tokens: Mapping[str, int],
    configs: Mapping[str, Mapping[str, Any]],
    divergence_expected: Collection[str] = EXPECTED_DIVERGENCE,
    ranks: int = RANKS,
) -> Any:
    """One rank: every group built by every rank in the same order, then the named scenarios."""

    def body(rank: int) -> dict[str, Any]:
        world = dist.new_group(list(range(ranks)), backend="gloo")
        pair = dist.new_group(list(range(ranks)), backend="gloo")
        singles = [dist.new_group([r], backend="gloo") for r in range(ranks)]
        assert world is not pair

        def checked(name: str) -> dict[str, Any]:
            """The scenario under upstream's rank-consensus checker over its attention groups: a
            divergence it finds fails the scenario, unless the scenario makes the ranks' trees or
            admissions differ on purpose (`divergence_expected`), where it is recorded instead."""
            topology = "tp" if name in scenarios else RANK_SCENARIOS[name].topology
            groups = _groups(topology, rank, world, pair, singles)
            # What Scheduler.init_rank_consensus_checker gives it: the attention-CP and -TP groups
            # (under DP attention each rank's own, so nothing is compared).
            attention = [groups["attn_cp_cpu_group"], groups["attn_tp_cpu_group"]]
            with forked_ranks.rank_consensus_checked(attention) as verdict:
                result = run(name)
            consensus[name] = bool(verdict.divergences)
            if verdict.divergences and name not in divergence_expected:
                found = verdict.divergences[0][:2000]
                raise AssertionError(f"upstream's rank-consensus checker found rank divergence: {found}")
            return result

        def run(name: str) -> dict[str, Any]:
            if name in scenarios:
                groups = _groups("tp", rank, world, pair, singles)
                chunk: dict[str, Any] = {"chunked_prefill_size": CHUNK} if name in CHUNKED_SCENARIOS else {}
                if name in kv_tokens:
                    chunk["kv_tokens"] = kv_tokens[name]
                chunk.update(configs.get(name, {}))
                with sh.build_harness(**ELASTIC, **chunk, tp_size=ranks, **groups) as h:
                    _drift_in_the_background(h, rank)
                    return scenarios[name](h, rank)
            scenario = RANK_SCENARIOS[name]
            groups = _groups(scenario.topology, rank, world, pair, singles)
            with sh.build_harness(**scenario.config, tp_size=ranks, **groups) as h:
                _drift_in_the_background(h, rank)
                skewed = rank == 0 and scenario.rank0_free_tokens is not None
                with _cotenant(h, scenario.rank0_free_tokens or 0) if skewed else contextlib.nullcontext():
                    return _rank_scenario(h, rank, scenario)

        out: dict[str, Any] = {}
        consensus: dict[str, bool] = {}
        for name in names:
            try:
                out[name] = checked(name)
            except Exception:  # this scenario's tests fail with it; the others still run
                out[name] = {SCENARIO_ERROR: traceback.format_exc()}
            dist.barrier(group=world)  # a hung scenario shows up as a timeout here
        out[CONSENSUS] = consensus
        return out

    return body


class TwoRanks(NamedTuple):
    results: dict[int, dict[str, Any]]  # rank -> scenario name -> what _rank_scenario saw
    errors: list[str]  # a rank's traceback, or a hang

    def checker_fired(self, name: str) -> dict[int, bool]:
        """Per rank, whether upstream's rank-consensus checker found a divergence in `name`."""
        assert not self.errors, "\n".join(self.errors)
        return {rank: result[CONSENSUS][name] for rank, result in self.results.items()}

    def scenario(self, name: str) -> dict[int, dict[str, Any]]:
        assert not self.errors, "\n".join(self.errors)
        found = {rank: result[name] for rank, result in self.results.items()}
        failed = [f"rank {rank}: {r[SCENARIO_ERROR]}" for rank, r in found.items() if SCENARIO_ERROR in r]
        assert not failed, "\n".join(failed)
        return found


def run_two_ranks(
    names: list[str],
    scenarios: Mapping[str, MultiRoundScenario] | None = None,
    kv_tokens: Mapping[str, int] | None = None,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    timeout_s: float = RANK_TIMEOUT_S,
    divergence_expected: Collection[str] = (),
    ranks: int = RANKS,
) -> TwoRanks:
    """Run the named scenarios on forked gloo ranks (two unless `ranks` says more, one TP group of
    them all): RANK_SCENARIOS, and multi-round ones
    from `scenarios` (this module's by default), built with `kv_tokens` and the harness options
    of `configs` where named. Upstream's rank-consensus checker is on in every one; where it fires
    the scenario fails, except in EXPECTED_DIVERGENCE and `divergence_expected` (made to differ on
    purpose), where `TwoRanks.checker_fired` tells."""
    with sh.build_harness():  # import sglang's model registry once, before forking
        pass
    body = _rank_body(
        names,
        MULTI_ROUND_SCENARIOS if scenarios is None else scenarios,
        KV_TOKENS if kv_tokens is None else kv_tokens,
        MULTI_ROUND_CONFIGS if configs is None and scenarios is None else configs or {},
        EXPECTED_DIVERGENCE | frozenset(divergence_expected),
        ranks,
    )
    results, errors = forked_ranks.run_forked_ranks(
        body, ranks=ranks, timeout_s=timeout_s, collective_timeout_s=30
    )
    return TwoRanks(results, errors)


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    """The scenarios of this module, run once on both ranks (the HiCache one belongs to the wait
    entry, test_unwind_waits_for_load.py)."""
    return run_two_ranks(
        [name for name in RANK_SCENARIOS if name != "tp_hicache_host"]
        + [name for name in MULTI_ROUND_SCENARIOS if name not in OWN_RANKS]
    )


@pytest.mark.parametrize("name", UNWIND_BOTH)
def test_two_ranks_one_miss_both_unwind(two_ranks: TwoRanks, name: str) -> None:
    ranks = two_ranks.scenario(name)
    site = RANK_SCENARIOS[name].site
    for rank, r in ranks.items():
        assert r["reported"] == ([site] if rank == MISSING_RANK else []), rank
        assert r["batch"] is None, rank  # the rank that did not miss unwinds too
        assert r["unwinds"] == 1, rank
        assert r["after"] == r["before"], rank  # and gives back what it allocated
        protected_before, protected_after = r["protected"]
        assert protected_after == protected_before, rank  # admission locks released
    assert ranks[0]["queue"] == ranks[1]["queue"] != []
    assert ranks[0]["chunked"] == ranks[1]["chunked"]
    assert ranks[0]["cap"] == ranks[1]["cap"] is not None
    # The next round (nothing armed) schedules the same requests on both ranks: the chunked
    # request, if any, then at most half of the unwound batch.
    chunked = [] if ranks[0]["chunked"] is None else [ranks[0]["chunked"]]
    assert ranks[0]["retry"] is not None and ranks[0]["retry"] == ranks[1]["retry"]
    assert ranks[0]["retry"][: len(chunked)] == chunked


@pytest.mark.parametrize("name", UNWIND_BOTH)
def test_two_ranks_requests_stay_in_step(two_ranks: TwoRanks, name: str) -> None:
    """The rank that did not miss must not move its requests' prefill progress on (cached_tokens,
    already_computed, extend_batch_idx, ping-pong indices) before the ranks agree: after the
    unwind and after the retry both ranks know the same about every request."""
    ranks = two_ranks.scenario(name)
    assert ranks[0]["state_after_unwind"] == ranks[1]["state_after_unwind"]
    assert ranks[0]["state_after_retry"] == ranks[1]["state_after_retry"]
    assert all(state[5] >= 0 for r in ranks.values() for state in r["state_after_retry"])


def test_a_first_turn_gives_its_session_slot_back(two_ranks: TwoRanks) -> None:
    """On the rank that allocated, a streaming session's first turn moved its admission lock into
    a new session slot. The unwind takes both back: no slot is left without its row (an abort
    while queued would then trip the session's one-slot assertion), the lock is released like any
    admission lock, and the retry opens the slot once, with one lock, on both ranks."""
    ranks = two_ranks.scenario("tp_session_first_turn")
    if ranks[0]["session_slots"] is None:
        pytest.skip("this line has no streaming-session slots")
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    # From 0.5.22 the first turn's allocation opens the slot (maybe_hand_to_session); up to
    # 0.5.21 the slot is opened only when the turn is cached, so the allocation hands nothing over.
    opened_by_allocation = hasattr(UnifiedRadixCache, "maybe_hand_to_session")
    for r in ranks.values():
        assert r["session_slots"] == {}
        assert r["session_slots_after_retry"] == ({"first-turn": True} if opened_by_allocation else {})


def test_dp_attention_ranks_do_not_agree(two_ranks: TwoRanks) -> None:
    """Under DP attention each rank schedules its own batch (attention-TP is one rank each):
    rank 1's miss unwinds rank 1 only, and the TP group, which spans both, is not used."""
    ranks = two_ranks.scenario("dp_attention_mamba")
    assert ranks[MISSING_RANK]["batch"] is None and ranks[MISSING_RANK]["unwinds"] == 1
    assert ranks[0]["batch"] is not None and len(ranks[0]["batch"]) == 4
    assert ranks[0]["unwinds"] == 0 and ranks[0]["cap"] is None


def test_two_ranks_with_different_free_space_admit_alike(two_ranks: TwoRanks) -> None:
    """Rank 0 has less free space than rank 1 (a co-tenant took most of it). The ranks agree on
    their free space before admission, so both admit the same batch, what fits rank 0, and run
    it: nothing is unwound, nothing is charged, and the next round runs the same on both."""
    ranks = two_ranks.scenario("tp_skewed_free")
    for r in ranks.values():
        assert r["reported"] == [] and r["unwinds"] == 0 and r["cap"] is None
    assert ranks[0]["batch"] is not None and ranks[0]["batch"] == ranks[1]["batch"]
    assert len(ranks[0]["batch"]) < 4  # what fits rank 0's 40 free tokens, not rank 1's
    assert ranks[0]["state_after_unwind"] == ranks[1]["state_after_unwind"]
    assert ranks[0]["queue"] == ranks[1]["queue"]
    assert ranks[0]["retry"] == ranks[1]["retry"]
    # Idle, rank 1 still reads rank 0's free space, which sglang's idle leak check would report
    # as a leak: idle, the scheduler reads each pool as it is again. (Rank 0's co-tenant still
    # holds its memory here, so its own check is not asked.)
    assert ranks[1]["idle_leaks_agreed"] != [] and ranks[1]["idle_leaks_released"] == []


def _loop(h: sh.Harness) -> EventLoopDriver:
    """SGLang's real event loop for the harness's configuration (event_loop_overlap, a server's
    default, unless it disables overlap), one iteration per step."""
    return (OverlapEventLoopDriver if h.cfg.enable_overlap else EventLoopDriver)(h)


Span = tuple[str, int, int]  # a request as a forward ran it: rid, prefix length, extend end


def _spans_at_forward(driver: EventLoopDriver) -> list[list[Span]]:
    """Per forward the loop runs (the model worker's, the only fake), each request of its batch as
    the forward saw it."""
    seen: list[list[Span]] = []
    forward = driver.worker.forward_batch_generation

    def spanned(batch: Any, **kwargs: Any) -> Any:
        seen.append([(r.rid, sh.prefix_len(r), sh.extend_end(r)) for r in batch.reqs])
        return forward(batch, **kwargs)

    driver.worker.forward_batch_generation = spanned  # type: ignore[method-assign]
    return seen


def _loop_round(driver: EventLoopDriver, spans: list[list[Span]]) -> Any:
    """One iteration of the loop: its batch's requests as the forward ran them (None: it ran no
    batch, a round put back or nothing to run), or the name of the error that stopped the
    scheduler."""
    forwards = len(spans)
    try:
        ran = driver.step()
    except Exception as error:  # the scheduler stopping
        return type(error).__name__
    return None if ran.forward_mode is None else spans[forwards]


def _rids(ran: Any) -> list[str] | None:
    return None if ran is None else [rid for rid, _, _ in ran]


EVICTION_PREFIXES = [list(range(2000 + 40 * i, 2000 + 40 * i + 32)) for i in range(6)]


def _skewed_eviction(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Both ranks cache the same six 32-token prefixes; a co-tenant leaves rank 0 only 16 free
    tokens. New requests need eviction, then one reuses the oldest prefix (the first LRU victim).
    Each iteration's batch (rid, prefix length, extend end) and the tree's evictable size after
    it (each request finishes with its prefill)."""
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    for prefix in EVICTION_PREFIXES:
        h.cache_prefix(prefix)
    rounds: list[Any] = []
    with _cotenant(h, 16) if rank == 0 else contextlib.nullcontext():
        for i in range(3):
            h.add_request(_prompt(i, 40), max_new_tokens=1)
        h.add_request([*EVICTION_PREFIXES[0], 7, 8, 9], max_new_tokens=1)
        for _ in range(12):
            rounds.append(_loop_round(driver, spans))
            rounds.append(h.tree_cache.evictable_size())
            if not h.scheduler.waiting_queue:
                break
    return {
        "rounds": rounds,
        "queue": [r.rid for r in h.scheduler.waiting_queue],
        "unwinds": sh.num_prefill_unwinds(h),
    }


def _cotenant_race(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Right after the ranks agreed on their free space, before admission, a co-tenant takes
    nearly all of rank 0's (the race no agreement can see coming). Both ranks admit by the agreed
    ledger, so alike; rank 0's allocation misses. The co-tenant then leaves; the next round
    agrees again, and both ranks do the same."""
    sched = h.scheduler
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    reqs = [h.add_request(_prompt(i)) for i in range(3)]
    with contextlib.ExitStack() as stack:
        if rank == 0 and not _after_the_agreement_before_admission(
            sched, stack, lambda: stack.enter_context(_cotenant(h, 2))
        ):  # a series that agrees on nothing before admission
            stack.enter_context(_cotenant(h, 2))
        raced = _loop_round(driver, spans)
        after_race = {
            "batch": _rids(raced),
            "unwinds": sh.num_prefill_unwinds(h),
            "divergences": getattr(sched, "num_prefill_divergences", 0),
            "charged": [_charged(r) for r in reqs],
            "queue": [r.rid for r in sched.waiting_queue],
        }
    return {**after_race, "agreed": _rids(_loop_round(driver, spans))}


def _trees_differ(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The ranks' trees differ (what per-rank eviction did before the ranks agreed on their free
    space): rank 0 has a 32-token prefix cached, rank 1 does not. With 64-token chunks both ranks
    schedule the request's first chunk with the same extend length, but rank 0 would compute
    tokens 32-96 and rank 1 tokens 0-64 of one batch. The fingerprint covers the prefix length, so
    the ranks put it back; the third such round in a row stops the scheduler, naming it."""
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    metrics = h.enable_metrics()
    prefix = list(range(3000, 3032))
    if rank == 0:
        h.cache_prefix(prefix)
    req = h.add_request([*prefix, *range(4000, 4100)])
    outcomes: list[Any] = []
    for _ in range(3):
        outcomes.append(_loop_round(driver, spans))
        if isinstance(outcomes[-1], str):
            break
    return {
        "outcomes": outcomes,
        "charged": _charged(req),
        "unwinds": sh.num_prefill_unwinds(h),
        "metrics": {name: metric.total for name, metric in metrics.items() if "prefill_" in name},
    }


def _admitted_apart(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Four requests share a 32-token prefix, which only rank 0 has cached (the ranks' trees
    differ): with 64-token chunks rank 0 admits all four (8 new tokens each), rank 1 two (the
    second chunked). The round is put back on both ranks, and the next round's admission cap is
    half the largest batch any rank admitted, the vote's, alike on both ranks (4 // 2 = 2): from
    its own batch rank 1 would cap at 1, and the ranks would admit differently again."""
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    prefix = list(range(3000, 3032))
    if rank == 0:
        h.cache_prefix(prefix)
    for i in range(4):
        h.add_request([*prefix, *range(4000 + 10 * i, 4008 + 10 * i)])
    outcome = _loop_round(driver, spans)
    return {"outcome": outcome, "cap": h.scheduler.prefill_unwind_admit_cap}


def _chunk_sizes_differ(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The ranks' chunk sizes differ in some rounds (rank 1's is 16 tokens smaller), so they
    schedule the same request from the same prefix to different extend ends: the fingerprint
    covers the extend end, so those rounds are put back everywhere. Two such rounds, a round with
    equal chunk sizes (it runs, and ends the run of divergences), then two more: never three in a
    row, so the scheduler does not stop."""
    sched = h.scheduler
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    own = sched.chunked_prefill_size
    h.add_request(_prompt(0, 300))
    outcomes: list[Any] = []
    for differ in (True, True, False, True, True):
        sched.chunked_prefill_size = own - 16 if differ and rank == 1 else own
        outcomes.append(_loop_round(driver, spans))
        if isinstance(outcomes[-1], str):
            break
    return {"outcomes": outcomes, "divergences": sched.num_prefill_divergences}


def _cotenant_within_a_round(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Right after the first round's agreement, a co-tenant takes part of rank 0's memory, not
    so much that the round misses: it runs on both ranks, and its vote carries rank 0's lower
    free space. The next round admits by that, alike on both ranks, and runs: nothing is put
    back. (An agreement kept from before the co-tenant would have rank 1 admit more.)"""
    sched = h.scheduler
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    h.add_request(_prompt(9), max_new_tokens=1)
    with contextlib.ExitStack() as stack:
        if rank == 0:
            taken: list[bool] = []

            def lose_memory_once() -> None:
                if not taken:
                    taken.append(True)
                    stack.enter_context(_cotenant(h, 60))

            _after_the_agreement_before_admission(sched, stack, lose_memory_once)
        rounds: list[Any] = []
        for prompts in ((), range(4)):
            for i in prompts:
                h.add_request(_prompt(i), max_new_tokens=1)
            rounds.append(_rids(_loop_round(driver, spans)))
        return {"rounds": rounds, "unwinds": sh.num_prefill_unwinds(h)}


def _cotenant_between_rounds(h: sh.Harness, rank: int) -> dict[str, Any]:
    """A round runs alike on both ranks, and its vote carries their free space to the next
    round. Before that next round, a co-tenant takes most of rank 0's memory: both ranks admit by
    the carried ledger, rank 0's allocation misses and the round is put back on both; the round
    after agrees afresh before admitting, and both ranks run the same batch, what fits rank 0."""
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    h.add_request(_prompt(9), max_new_tokens=1)
    assert _loop_round(driver, spans) is not None
    reqs = [h.add_request(_prompt(i), max_new_tokens=1) for i in range(4)]
    rounds: list[Any] = []
    with _cotenant(h, 40) if rank == 0 else contextlib.nullcontext():
        for _ in range(2):
            rounds.append(_rids(_loop_round(driver, spans)))
    return {
        "rounds": rounds,
        "unwinds": sh.num_prefill_unwinds(h),
        "charged": [_charged(r) for r in reqs],
    }


def _idle_round_keeps_the_cap(h: sh.Harness, rank: int) -> dict[str, Any]:
    """After an unwind (rank 1 missed; the running request decodes in that iteration) the next
    round admits nothing on either rank (the running batch is full): the ranks' vote is IDLE,
    which must not lift the back-off cap."""
    sched = h.scheduler
    driver = _loop(h)
    running = h.add_request(_prompt(9), max_new_tokens=32)
    assert driver.step().rids == (running.rid,)
    for i in range(4):
        h.add_request(_prompt(i))
    with h.arm_miss("token_slots") if rank == MISSING_RANK else _no_miss():
        unwound = driver.step()
    cap_after_unwind = sched.prefill_unwind_admit_cap
    sched.running_batch.batch_is_full = True  # nothing can be admitted this round, on any rank
    idle = driver.step()
    return {
        "unwound_iteration": (unwound.forward_mode, unwound.rids),
        "cap_after_unwind": cap_after_unwind,
        "idle": (idle.forward_mode, idle.rids),
        "cap_after_idle": sched.prefill_unwind_admit_cap,
    }


def _drifting(start: int) -> Iterator[int]:
    """What co-tenants hold of one rank's GPU, from `start` tokens, changing at every reading
    (kvcached caches its physical reading for 100 ms, refreshed by its own and not by a
    sibling's calls)."""
    return itertools.cycle([start + step for step in (0, 3, 1, 4, 2)])


def _drift_rounds(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Rank 0's real free space drifts at every reading, near capacity; rank 1's holds. Every
    iteration admits, allocates and finishes requests of several sizes. What each decision reads
    (the pools' free space) and what each round admitted must be the same on both ranks."""
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    if rank == 0:
        assert h.physical is not None
        h.physical.drift(_drifting(h.physical.uniform() - 170))
    rounds: list[Any] = []
    readings: list[int] = []
    pending = [h.add_request(_prompt(i, 30 + 7 * (i % 4)), max_new_tokens=1) for i in range(12)]
    for _ in range(16):
        rounds.append(_rids(_loop_round(driver, spans)))
        readings.append(h.token_to_kv_pool_allocator.available_size())
        if not h.scheduler.waiting_queue:
            break
    return {
        "rounds": rounds,
        "readings": readings,
        "divergences": h.scheduler.num_prefill_divergences,
        "left": len(pending) - sum(len(r) for r in rounds if r),
    }


def _drift_rounds_checking_prefetches(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The drifting rounds above, with every queued request's L3 prefetch in flight: admission
    checks each candidate's prefetch (check_prefetch_progress), and where a prefetch is still
    running upstream decides whether to end it with an all-reduce over the tree cache's attention
    groups (_can_terminate_prefetch, marked rank_consensus). The storage is the fake here: each
    check makes that all-reduce, then reports the prefetch done. If one rank stopped admitting
    earlier than the other (its own reading said the pool was full), the other would check one
    request more, and its all-reduce would meet the peer's vote, or nothing: a hang."""
    sched, tree_cache = h.scheduler, h.tree_cache
    checks: list[str] = []
    real_check = tree_cache.check_prefetch_progress

    def check_prefetch_in_flight(request: Any) -> bool:
        checks.append(request.rid)
        terminate = torch.tensor([1], dtype=torch.int64)
        tree_cache._all_reduce_attn_groups(terminate, dist.ReduceOp.MIN)
        return bool(real_check(request))

    with (
        mock.patch.object(sched, "enable_hicache_storage", True),
        mock.patch.object(tree_cache, "check_prefetch_progress", check_prefetch_in_flight),
    ):
        result = _drift_rounds(h, rank)
    return {**result, "checks": checks}


def _decode_after_vote(h: sh.Harness, rank: int) -> dict[str, Any]:
    """A prefill round runs alike; while it allocates, a co-tenant takes nearly all of rank 0's
    memory, and from then on rank 0's real reading drifts at every read. The round's vote agrees
    on the least free space; the running batch's next decode step (the loop's next iteration)
    needs more than that, so it retracts: by the agreed ledger, the same requests on both ranks
    (by rank 0's drifting real reading, different requests at each try)."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    driver = _loop(h)
    reqs = [h.add_request(_prompt(i, 40)) for i in range(5)]
    with contextlib.ExitStack() as stack:
        if rank == 0:
            settle = sched._settle_prefill_round

            def lose_memory_then_settle(batch: Any, allocated: bool) -> Any:
                assert h.physical is not None
                h.physical.drift(_drifting(h.physical.uniform() - 4))
                return settle(batch, allocated)

            stack.enter_context(mock.patch.object(sched, "_settle_prefill_round", lose_memory_then_settle))
        prefill = driver.step()
    assert prefill.forward_mode == "EXTEND" and len(prefill.rids) > 1
    before = h.token_to_kv_pool_allocator.available_size()
    decode = driver.step()
    return {
        "running": list(prefill.rids),
        "queued": [r.rid for r in reqs if r.rid not in prefill.rids],
        "before": before,
        "decoded": (decode.forward_mode, decode.rids),
        "retracted": sorted(set(prefill.rids) - set(decode.rids)),
        "after": h.token_to_kv_pool_allocator.available_size(),
    }


def _no_agreement_helper(h: sh.Harness, rank: int) -> dict[str, Any]:
    """A tree cache with no agreement helper of its own (0.5.20's ChunkCache under
    --disable-radix-cache with chunked prefill, RadixCacheCpp, PureSWARadixCache, FlexKV, a
    --radix-cache-backend plugin): the ranks agree over the scheduler's own attention groups.
    Rank 0's reading is lowered (no miss): both admit what fits rank 0. Then rank 1 misses: both
    put the round back, and retry alike."""
    driver = _loop(h)
    spans = _spans_at_forward(driver)
    rounds: list[Any] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", None))
        if rank == 0:
            stack.enter_context(_cotenant(h, 40))
        for i in range(4):
            h.add_request(_prompt(i), max_new_tokens=1)
        for miss in (False, True, False):
            with h.arm_miss("token_slots") if miss and rank == MISSING_RANK else _no_miss():
                rounds.append(_rids(_loop_round(driver, spans)))
    return {"rounds": rounds, "unwinds": sh.num_prefill_unwinds(h), "queue": len(h.scheduler.waiting_queue)}


MULTI_ROUND_SCENARIOS: dict[str, MultiRoundScenario] = {
    "tp_no_agreement_helper": _no_agreement_helper,
    "tp_drift_rounds": _drift_rounds,
    "tp_drift_prefetch_checks": _drift_rounds_checking_prefetches,
    "tp_decode_after_vote": _decode_after_vote,
    "tp_skewed_eviction": _skewed_eviction,
    "tp_cotenant_race": _cotenant_race,
    "tp_cotenant_between_rounds": _cotenant_between_rounds,
    "tp_cotenant_within_a_round": _cotenant_within_a_round,
    "tp_trees_differ": _trees_differ,
    "tp_chunk_sizes_differ": _chunk_sizes_differ,
    "tp_idle_round": _idle_round_keeps_the_cap,
    "tp_admitted_apart": _admitted_apart,
}


CHUNKED_SCENARIOS = {"tp_trees_differ", "tp_chunk_sizes_differ", "tp_admitted_apart"}
# Built with a pool this size (the default else).
KV_TOKENS = {"tp_drift_rounds": 256, "tp_drift_prefetch_checks": 256, "tp_decode_after_vote": 256}
# Each on event_loop_normal (--disable-overlap-schedule): a request that ends with its prefill
# ends in that iteration, so each iteration is one prefill round and its requests' release.
MULTI_ROUND_CONFIGS: dict[str, dict[str, Any]] = {
    name: {"enable_overlap": False} for name in MULTI_ROUND_SCENARIOS
}
# Run on their own ranks: on a series where the ranks' collectives stop lining up, a scenario
# would leave the next one's collectives misaligned too.
OWN_RANKS = {"tp_drift_prefetch_checks"}


def test_ranks_with_different_free_space_evict_alike(two_ranks: TwoRanks) -> None:
    """With rank 0 short of free space, eviction follows the agreed free space on both ranks, so
    the trees stay mirrored: every round both ranks schedule the same requests with the same
    prefix lengths and extend ranges (a request reusing the first prefix evicted included), and
    their evictable sizes stay equal. Without it rank 0 evicts more, and a prefix cached on one
    rank only either stalls the request or runs different token ranges on the two ranks."""
    ranks = two_ranks.scenario("tp_skewed_eviction")
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    assert ranks[0]["queue"] == ranks[1]["queue"] == []
    assert any(batch for batch in ranks[0]["rounds"][::2])


def test_ranks_whose_trees_differ_never_run_the_batch(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_trees_differ")
    for r in ranks.values():
        assert r["outcomes"] == [None, None, "PrefillRankDivergence"]
        assert r["charged"] == 0


def test_ranks_whose_chunks_end_apart_never_run_the_batch_and_a_good_round_resets_the_count(
    two_ranks: TwoRanks,
) -> None:
    ranks = two_ranks.scenario("tp_chunk_sizes_differ")
    assert ranks[0]["outcomes"] == ranks[1]["outcomes"]
    diverged, again, good, third, fourth = ranks[0]["outcomes"]
    assert diverged is again is third is fourth is None
    assert good is not None and [(prefix, end) for _, prefix, end in good] == [(0, CHUNK)]
    for r in ranks.values():
        assert r["divergences"] == 4


def test_a_drifting_reading_admits_alike_on_every_rank(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_drift_rounds")
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    assert ranks[0]["readings"] == ranks[1]["readings"]
    for r in ranks.values():
        assert r["divergences"] == 0 and r["left"] == 0


def test_a_drifting_reading_checks_the_same_prefetches_on_every_rank() -> None:
    """Finding 1: an admission collective (upstream's prefetch-termination all-reduce) is reached
    by every rank in the same order, however the readings drift: both ranks finish every round
    within the collectives' timeout, having checked the same prefetches in the same order."""
    # A run takes about 12 s; ranks whose collectives stop lining up hang until the bound.
    ranks = run_two_ranks(["tp_drift_prefetch_checks"], timeout_s=90).scenario("tp_drift_prefetch_checks")
    assert ranks[0]["checks"] == ranks[1]["checks"] != []
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    for r in ranks.values():
        assert r["divergences"] == 0 and r["left"] == 0


def test_a_drifting_reading_retracts_alike_on_every_rank(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_decode_after_vote")
    assert ranks[0] == ranks[1]
    assert ranks[0]["retracted"] != []  # the agreed free space fits no step of the whole batch


def test_a_round_where_no_rank_admits_keeps_the_cap(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_idle_round")
    assert ranks[0] == ranks[1]
    for r in ranks.values():
        # The unwound round's iteration and the next both decode the running request only.
        assert r["unwound_iteration"][0] == r["idle"][0] == "DECODE", r
        assert r["cap_after_unwind"] is not None
        assert r["cap_after_idle"] == r["cap_after_unwind"]


def test_ranks_that_admitted_apart_cap_the_next_round_alike(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_admitted_apart")
    assert ranks[0]["outcome"] == ranks[1]["outcome"] is None  # put back on both ranks
    assert ranks[0]["cap"] == ranks[1]["cap"] == 2


def test_a_cotenant_race_is_one_miss_agreed_on_every_rank(two_ranks: TwoRanks) -> None:
    """Both ranks admit by the agreed ledger, so they admit the same batch although rank 0 lost
    its memory after the agreement: rank 0's allocation misses, the vote puts the batch back on
    both, charged alike (a miss, not a divergence), and the next round agrees afresh."""
    ranks = two_ranks.scenario("tp_cotenant_race")
    for r in ranks.values():
        assert r["batch"] is None
        assert r["unwinds"] == 1 and r["divergences"] == 0
    assert ranks[0]["charged"] == ranks[1]["charged"]
    assert ranks[0]["queue"] == ranks[1]["queue"]
    assert ranks[0]["agreed"] == ranks[1]["agreed"]


def test_a_cotenant_between_rounds_costs_one_put_back_round(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_cotenant_between_rounds")
    for r in ranks.values():
        assert r["rounds"][0] is None and r["unwinds"] == 1
        assert r["rounds"][1] is not None and 0 < len(r["rounds"][1]) < 4  # what fits rank 0
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    assert ranks[0]["charged"] == ranks[1]["charged"]


def test_the_vote_carries_the_free_space_the_round_ended_with(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_cotenant_within_a_round")
    for r in ranks.values():
        assert r["unwinds"] == 0 and None not in r["rounds"]
        assert 0 < len(r["rounds"][1]) < 4  # what fits rank 0 after its co-tenant
    assert ranks[0]["rounds"] == ranks[1]["rounds"]


# Every pool the agreement consults, each of which turns it on alone.
CONSULTED_POOLS: dict[str, Any] = {
    "allocator": lambda h: h.token_to_kv_pool_allocator,
    "kv_cache": lambda h: h.token_to_kv_pool_allocator.get_kvcache(),
    "request_pool": lambda h: h.req_to_token_pool,
    "mamba_pool": lambda h: h.req_to_token_pool.mamba_pool,
    "mamba_slots": lambda h: getattr(h.req_to_token_pool, "mamba_allocator", None),
}


@pytest.mark.parametrize("pool", sorted(CONSULTED_POOLS))
def test_a_rank_local_pool_turns_the_agreement_on(pool: str) -> None:
    """A pool that declares `rank_local_capacity` (kvcached's elastic pools do) turns the
    agreement on, whichever of the consulted pools it is: the first round with requests to admit
    agrees on the free space of the pools that report one, then votes once after allocating,
    through the tree cache's own all-reduce over the attention groups. A round with nothing to
    admit (nothing queued, no chunk) makes no collective: no rank can admit in it."""
    with sh.build_harness(**MAMBA) as h:
        declaring = CONSULTED_POOLS[pool](h)
        if declaring is None:
            pytest.skip(f"this line has no {pool}")
        declaring.rank_local_capacity = True
        if callable(getattr(declaring, "available_size", None)):
            # sglang's own pools count their free space from their own calls, alike on every rank
            counted_alike(declaring)
        votes: list[list[int]] = []
        real = h.tree_cache._all_reduce_attn_groups

        def all_reduce_attn_groups(tensor: torch.Tensor, op: Any) -> None:
            votes.append(tensor.tolist())
            real(tensor, op)

        with mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", all_reduce_attn_groups):
            h.add_request(_prompt(0))
            assert h.run_round() is not None
            per_admitting_round = len(votes)
            assert h.run_round() is None
        free_space = votes[:-1]
        # One reading per pool that reports free space (a KV cache, a Mamba state pool: none).
        readings = int(callable(getattr(declaring, "available_size", None)))
        by_deficit = agrees_by_deficit(h.scheduler)
        head = ballot_head_fields() if by_deficit else 4
        per_pool = ballot_fields_per_pool() if by_deficit else 1
        if by_deficit:
            # RankAgreement: one ballot, its deficits (uniform minus real: 0 for sglang's own
            # pools) in every vote, also before the first admission.
            assert [len(vote) for vote in free_space] in ([], [head + per_pool * readings])
            assert all(vote[head : head + readings] == [0] * readings for vote in free_space)
        else:
            assert len(free_space) == readings
            assert all(free < 0 for free in (free_space or [[-1]])[0])  # MIN as MAX of negatives
        missed, fingerprint, neg_fingerprint, batch_size = votes[-1][:4]
        carried = votes[-1][head : head + readings]
        assert (missed, batch_size) == (0, 1) and fingerprint == -neg_fingerprint != 0
        assert len(votes[-1]) == head + per_pool * readings
        assert all(deficit == 0 if by_deficit else deficit < 0 for deficit in carried)
        assert len(votes) == per_admitting_round  # the empty round made no collective


def test_an_admitting_round_makes_one_collective_once_agreed() -> None:
    """The vote after a round's allocation carries each rank-local pool's free space, which is
    the next round's agreement when every rank allocated alike: from the second admitting round
    on, one collective per round. A round put back, and the scheduler going idle, make the next
    round agree afresh before its admission (two collectives)."""
    with sh.build_harness(elastic=True) as h:
        collectives: list[int] = []
        real = h.tree_cache._all_reduce_attn_groups

        def all_reduce_attn_groups(tensor: torch.Tensor, op: Any) -> None:
            collectives[-1] += 1
            real(tensor, op)

        def admitting_round(prompt: int, miss: sh.MissSite | None = None) -> Any:
            h.add_request(_prompt(prompt))
            collectives.append(0)
            with h.arm_miss(miss) if miss else _no_miss():
                batch = h.run_round()
            for req in [] if batch is None else batch.reqs:
                h.finish_request(req)
            h.prepare_next_round()
            return batch

        with mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", all_reduce_attn_groups):
            assert admitting_round(0) is not None  # first: agree, then vote
            assert admitting_round(1) is not None  # the first vote carried the agreement
            assert admitting_round(2, miss="token_slots") is None  # put back
            assert admitting_round(3) is not None  # after a put-back: agree afresh
            assert admitting_round(4) is not None
            h.scheduler._release_agreed_free_space()  # what on_idle does once fully idle
            assert admitting_round(5) is not None
        # The missed round makes a second collective, after the vote: how long its requests have
        # been missing, the most any rank measured (the wall-clock deadline, alike on every rank).
        missed_round = 2 if hasattr(h.scheduler, "_prefill_unwind_clock") else 1
        if agrees_by_deficit(h.scheduler):
            # RankAgreement: the vote agrees the deficit whatever the outcome, and going idle
            # keeps it: after the first round, one collective per admitting round, always.
            assert collectives == [2, 1, missed_round, 1, 1, 1]
        else:
            assert collectives == [2, 1, missed_round, 2, 1, 2]


# What the event loop gives on_idle that the harness does not build: reporting and housekeeping
# objects (metrics, load publishing, health checks, KV events), each a recording stand-in.
EVENT_LOOP_OBJECTS = (
    "dp_attn_adapter",
    "maybe_send_health_check_signal",
    "metrics_reporter",
    "scheduler_stage_metrics",
    "invariant_checker",
    "pool_stats_observer",
    "kv_events_publisher",
    "new_token_ratio_tracker",
    "publish_load_snapshot",
    "load_publisher",
    "load_inquirer",
)


def test_the_real_idle_path_reads_the_pools_as_they_are_before_the_leak_check() -> None:
    """Once the scheduler is fully idle (on every rank alike), the real `on_idle` lets each pool
    read as it is before upstream's idle leak check reads the pools (else the check compares
    the ledger with the pool and reports a leak where a co-tenant's memory came back; the next
    admitting round then agrees afresh). An on_idle that is not fully idle keeps the agreement."""
    with sh.build_harness(elastic=True) as h:
        sched = h.scheduler
        allocator = h.token_to_kv_pool_allocator
        physical = h.physical
        assert physical is not None
        h.add_request(_prompt(0))
        batch = h.run_round()
        assert batch is not None and _reads_the_ledger(sched)
        for req in batch.reqs:
            h.finish_request(req)
        h.prepare_next_round()
        physical.take(10)  # a co-tenant maps memory away after the agreement
        seen_by_leak_check: list[tuple[bool, int, int]] = []

        def check_all_pools(*args: Any) -> tuple[bool, list[str]]:
            seen_by_leak_check.append(
                (_reads_the_ledger(sched), allocator.available_size(), physical.available())
            )
            return False, []

        with contextlib.ExitStack() as stack:
            for name in EVENT_LOOP_OBJECTS:
                stack.enter_context(mock.patch.object(sched, name, mock.MagicMock(), create=True))
            sched.invariant_checker._check_all_pools.side_effect = check_all_pools
            stack.enter_context(h.nothing_in_flight())
            # No unified memory, no idle sleeper, no load publish yet: the rest of on_idle's state.
            idle_state: dict[str, Any] = {
                "_last_stall_publish_ts": 0.0,
                "enable_unified_memory": False,
                "idle_sleeper": None,
            }
            for name, value in idle_state.items():
                stack.enter_context(mock.patch.object(sched, name, value, create=True))
            stack.enter_context(mock.patch("time.sleep"))
            queued = h.add_request(_prompt(1))
            sched.on_idle()  # a request waits: not idle
            assert _reads_the_ledger(sched) and seen_by_leak_check == []
            sched.waiting_queue.remove(queued)
            sched.on_idle()
        [(current, reading, real)] = seen_by_leak_check
        assert not current and reading == real


def test_a_put_back_round_whose_next_round_only_continues_a_chunk_agrees_afresh() -> None:
    """After a round is put back, the next admitting round agrees on the real free space before
    it admits, also when all it has to admit is the continuing chunk (nothing queued): sized by
    the stale ledger instead, the chunk would miss again at every round for as long as the
    co-tenant holds the memory."""
    with sh.build_harness(elastic=True, chunked_prefill_size=CHUNK) as h:
        sched = h.scheduler
        long = _start_chunked(h, 200)
        assert h.physical is not None and _reads_the_ledger(sched)
        h.physical.take(h.physical.uniform() - 40)  # a co-tenant leaves 40 tokens: a chunk misses
        assert h.run_round() is None  # put back
        # Before RankAgreement the put-back round leaves no agreement, and the next agrees afresh;
        # from it on the put-back round's vote agreed the deficit the co-tenant made.
        assert _reads_the_ledger(sched) == agrees_by_deficit(sched)
        assert sched.waiting_queue == [] and sched.chunked_req is long
        batch = h.run_round()
        assert batch is not None and batch.reqs == [long] and _reads_the_ledger(sched)
        assert CHUNK < sh.extend_end(long) <= CHUNK + 40


class _DelayerReadThePools(Exception):
    """Stops a round where the prefill delayer reads the pools' usage."""


def test_the_ranks_agree_before_the_prefill_delayer_reads_the_pools() -> None:
    """The prefill delayer sizes its decision from the pools' usage and negotiates it over the TP
    group: it must read the agreed free space, so the agreement comes first in the round."""
    with sh.build_harness(elastic=True) as h:
        sched = h.scheduler
        agreed_when_read: list[bool] = []

        def get_pool_stats() -> Any:
            agreed_when_read.append(_reads_the_ledger(sched))
            raise _DelayerReadThePools

        h.add_request(_prompt(0))
        observer = types.SimpleNamespace(get_pool_stats=get_pool_stats)
        with (
            mock.patch.object(sched, "prefill_delayer", object()),
            # The harness's scheduler has no observer of its own.
            mock.patch.object(sched, "pool_stats_observer", observer, create=True),
            pytest.raises(_DelayerReadThePools),
        ):
            h.run_round()
        assert agreed_when_read == [True]


def test_a_tree_cache_without_an_agreement_helper_agrees_over_the_schedulers_groups(
    two_ranks: TwoRanks,
) -> None:
    ranks = two_ranks.scenario("tp_no_agreement_helper")
    assert ranks[0] == ranks[1]
    first, missed, retry = ranks[0]["rounds"]
    assert first is not None and 0 < len(first) < 4  # what fits rank 0's 40 free tokens
    assert missed is None and ranks[0]["unwinds"] == 1  # rank 1's miss, put back on both
    assert retry is not None


def test_a_rank_local_pool_under_pipeline_parallelism_is_refused_by_name() -> None:
    """Pipeline stages admit on their own pools and nothing agrees across them: a rank-local pool
    there is refused (at start-up), naming the flag, rather than run stages that disagree."""
    with sh.build_harness(elastic=True) as h:
        parallel = types.SimpleNamespace(pp_size=2)
        with (
            mock.patch("sglang.srt.managers.scheduler.get_parallel", return_value=parallel),
            pytest.raises(ValueError, match=r"--pp-size 2"),
        ):
            h.scheduler._prefill_agreement  # noqa: B018  (the property is what refuses)


def test_a_kvcached_attribute_alone_turns_nothing_on() -> None:
    """The capability is declared, not guessed from kvcached's own attribute names."""
    with sh.build_harness() as h:
        h.token_to_kv_pool_allocator.kvcached_allocator = object()
        with mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", side_effect=AssertionError("agreed")):
            h.add_request(_prompt(0))
            assert h.run_round() is not None


def test_a_composite_pool_answers_for_its_parts() -> None:
    """A hybrid-SWA allocator reads its free space from its full and SWA sub-allocators, which
    kvcached makes elastic: it reports rank-local capacity when one of them does, and the pools
    whose readings the agreement adjusts are the sub-allocators (never both levels)."""
    from sglang.srt.mem_cache.allocator.base import has_rank_local_capacity, rank_local_pools

    full = TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False)
    swa = TokenToKVPoolAllocator(32, torch.float16, "cpu", None, False)
    composite = SWATokenToKVPoolAllocator.__new__(SWATokenToKVPoolAllocator)
    composite.full_attn_allocator, composite.swa_attn_allocator = full, swa
    assert not has_rank_local_capacity(composite) and rank_local_pools(composite) == []
    swa.rank_local_capacity = True
    assert has_rank_local_capacity(composite)
    assert rank_local_pools(composite) == [swa]
    composite.rank_local_capacity = True  # declared on the composite itself too
    assert rank_local_pools(composite) == [swa]

    # The hybrid-SWA KV pool, likewise (kvcached makes its full and SWA pools elastic).
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    kv_pool = SWAKVPool.__new__(SWAKVPool)
    static, elastic = types.SimpleNamespace(), types.SimpleNamespace(rank_local_capacity=True)
    kv_pool.full_kv_pool, kv_pool.swa_kv_pool = static, elastic
    assert has_rank_local_capacity(kv_pool) and rank_local_pools(kv_pool) == [elastic]


class _ElasticMambaPool:
    """kvcached's elastic Mamba state pool at its boundary: free slots of its own, and the GPU
    memory to map them, which a co-tenant shares."""

    rank_local_capacity = True

    def __init__(self, slots: int, mappable: int) -> None:
        self.slots, self.mappable = slots, mappable

    def uniform_available_size(self) -> int:
        return self.slots

    def real_available_size(self) -> int:
        return min(self.slots, self.mappable)

    def agree_deficit(self, deficit: int | None) -> None:
        self.deficit = deficit

    def available_size(self) -> int:
        deficit = getattr(self, "deficit", None)
        return self.real_available_size() if deficit is None else max(0, self.slots - deficit)


class _ElasticMambaSlots:
    """kvcached's ElasticMambaSlotAllocator: its free space is its Mamba pool's reading
    (kvcached integration/sglang/patches.py:2008-2012)."""

    rank_local_capacity = True

    def __init__(self, pool: _ElasticMambaPool) -> None:
        self.mamba_pool = pool

    def available_size(self) -> int:
        deficit: int | None = getattr(self, "deficit", None)
        if deficit is None:
            return self.real_available_size()
        return max(0, self.uniform_available_size() - deficit)

    def real_available_size(self) -> int:
        return self.mamba_pool.real_available_size()

    def agree_deficit(self, deficit: int | None) -> None:
        self.deficit = deficit

    def uniform_available_size(self) -> int:
        return self.mamba_pool.uniform_available_size()


def test_a_pool_read_through_another_is_agreed_once() -> None:
    """Ranks whose Mamba memory differs (100 vs 150 mappable slots) agree on the least; the slot
    allocator, which reads the pool's reading, must read the agreed 100 on both ranks, not the
    agreement applied twice (100 vs 50), and after both allocate alike, the same again."""
    try:
        from sglang.srt.mem_cache.rank_agreement import RankAgreement
    except ImportError:  # the series' first agreement (AgreedCapacity)
        _agree_through_another_with_agreed_capacity()
        return
    pools = [_ElasticMambaPool(200, mappable) for mappable in (100, 150)]
    parts = [(pool, _ElasticMambaSlots(pool)) for pool in pools]
    agreements = [RankAgreement(lambda vote: None, list(pair)) for pair in parts]

    def vote_together() -> None:
        ballots = [agreement.ballot(missed=False, fingerprint=0, batch_size=0) for agreement in agreements]
        for rank, agreement in enumerate(agreements):
            peer = ballots[1 - rank].encode()
            agreement.reduce = lambda vote, peer=peer: vote.copy_(torch.maximum(vote, peer))
            agreement.vote(ballots[rank])

    def readings() -> list[list[int]]:
        return [[pool.available_size(), slots.available_size()] for pool, slots in parts]

    vote_together()
    assert readings() == [[100, 100]] * 2
    for pool in pools:
        pool.slots -= 30  # both ranks allocate alike
    pools[1].mappable = 0  # and then a co-tenant takes rank 1's memory: that shows as a miss
    assert readings() == [[70, 70]] * 2
    # The co-tenant leaves and the ranks vote again: the slot allocator's deficit is measured from
    # its pool's real reading (100 on rank 0), never the pool's ledger (70).
    pools[1].mappable = 150
    vote_together()
    assert readings() == [[100, 100]] * 2


def _agree_through_another_with_agreed_capacity() -> None:
    from sglang.srt.managers.scheduler import PrefillAgreement, Scheduler
    from sglang.srt.mem_cache.allocation import AgreedCapacity

    pools = [_ElasticMambaPool(200, mappable) for mappable in (100, 150)]
    parts = [(pool, _ElasticMambaSlots(pool)) for pool in pools]
    capacities = [AgreedCapacity(list(pair)) for pair in parts]
    measured = [capacity.measure() for capacity in capacities]

    def with_peer(peer: list[int]) -> Any:
        def reduce(vote: torch.Tensor) -> None:  # the all-reduce (MAX of negatives) with the peer
            vote.copy_(torch.maximum(vote, torch.tensor([-free for free in peer])))

        return reduce

    for rank, capacity in enumerate(capacities):
        Scheduler._agree_on_free_space(None, PrefillAgreement(with_peer(measured[1 - rank]), capacity))
    assert [[pool.available_size(), slots.available_size()] for pool, slots in parts] == [[100, 100]] * 2
    for pool in pools:
        pool.slots -= 30  # both ranks allocate alike
    pools[1].mappable = 0  # and then a co-tenant takes rank 1's memory: that shows as a miss
    assert [[pool.available_size(), slots.available_size()] for pool, slots in parts] == [[70, 70]] * 2
    # The co-tenant leaves and the ranks agree afresh (as after a put-back): the slot allocator's
    # real reading is its pool's real one (100 on rank 0), never the pool's ledger (70).
    pools[1].mappable = 150
    for capacity in capacities:
        capacity.expire()  # what a put-back round does
    measured = [capacity.measure() for capacity in capacities]
    for rank, capacity in enumerate(capacities):
        Scheduler._agree_on_free_space(None, PrefillAgreement(with_peer(measured[1 - rank]), capacity))
    assert [[pool.available_size(), slots.available_size()] for pool, slots in parts] == [[100, 100]] * 2


def test_a_rank_local_pool_that_cannot_be_counted_alike_is_refused_by_name() -> None:
    """A pool that declares rank-local free space but no reading its own calls alone change
    cannot be kept alike on every rank: the scheduler refuses it (at start-up: Scheduler.__init__
    reads the agreement), naming the pool and what it lacks."""
    with sh.build_harness() as h:
        h.token_to_kv_pool_allocator.rank_local_capacity = True
        with pytest.raises(
            ValueError, match=r"TokenToKVPoolAllocator.* declares rank_local_capacity but (has no|lacks)"
        ):
            h.scheduler._prefill_agreement  # noqa: B018  (the property is what refuses)


@pytest.mark.parametrize("name", sorted(EXPECTED_DIVERGENCE & set(MULTI_ROUND_SCENARIOS)))
def test_upstreams_checker_finds_the_divergence_a_scenario_makes_on_purpose(
    two_ranks: TwoRanks, name: str
) -> None:
    """The negative control of upstream's rank-consensus checker, which every two-rank scenario
    here runs under (a divergence it finds elsewhere fails that scenario): where the ranks' trees,
    chunk sizes or admissions differ on purpose, both ranks' checkers find it."""
    assert two_ranks.checker_fired(name) == {0: True, 1: True}
