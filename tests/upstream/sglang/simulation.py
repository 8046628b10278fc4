"""A randomized simulation of two ranks (three in some seeds) running the REAL sglang event loop,
deterministic per seed
(in the spirit of FoundationDB's simulation testing).

A seed decides everything the ranks share (`plan`): the pool (page size, KV tokens, Mamba state,
HiCache), the prefill chunk, and the traffic: requests with random prompt and output lengths,
some sharing a prefix, arriving at random iterations with idle gaps between waves, some aborted at
a random later iteration. Each rank also gets what only it sees, from the seed and its rank:
co-tenants of a kvcached-shaped pool that take and return physical memory, their reading drifting
at every read (`SimPlan.co_tenants`). The co-tenants leave after `CO_TENANTS_LEAVE_AT`, so every
request can finish.

Each rank drives `event_loop_driver.EventLoopDriver` (event_loop_normal's iteration) or, in about
half the seeds (drawn apart from the rest of the plan), `OverlapEventLoopDriver`
(event_loop_overlap's, which processes each batch's result one iteration later); the model
forward is the only fake. It records, per iteration, the batch it ran (forward mode, requests,
prefill tokens) and every collective it made, in order (operation, group, reduce op, shape and
dtype; `torch.distributed`'s functions wrapped for the run). `judge` compares the two ranks'
records: the same batch and the same collectives in every iteration, no exception on either rank,
every request finished or aborted with a reason, and no leak once idle (the harness's own check;
the loop's `on_idle` makes upstream's). A seed that fails names itself; `replay_command` is the
one line that runs it alone.

With HiCache on, most seeds let each device copy (a write-through backup, a load) land at a random
later iteration, on each rank by its own schedule (`SimPlan.copy_landing`).

Some seeds, each drawn apart from the rest of the plan (so a seed's traffic is the same with or
without them): a PD prefill server (`SimPlan.pd_prefill`: the disaggregated prefill loop, requests
through the bootstrap queue, KV sent by upstream's fake transfer backend); mixed chunked prefill
(`SimPlan.mixed_chunk`); and a one-rank quarantine (`SimPlan.quarantine`: for a window of iterations
rank 1's GPU sets aside pages it has not mapped, as kvcached quarantines pages whose mapping failed,
or a shrink takes them, on one GPU at its own moment): its real reading drops, its own reading
(which counts from the pool's virtual size) does not, and the ranks must still run alike; and a
third rank in the TP group (`SimPlan.ranks`), with its own co-tenants, copies and mapped memory,
so that every reduction has a rank between the least and the most.

In some seeds about half the requests ask for a grammar (`SimRequest.grammar`): upstream's real
`GrammarManager` holds them until their grammar compiles, which each rank's backend lets happen at
an iteration of its own, or never on one rank (upstream then times it out on every rank); see
sim_grammar.py.

Not simulated (stated, not hidden): L3 storage, HiCache buffer mode, speculative decoding, PD
decode, dLLM, more than three ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shlex
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import scheduler_harness as sh
import sim_grammar
import torch
import torch.distributed as dist
from event_loop_driver import LOOP_THREAD_NAME, EventLoopDriver, Iteration, OverlapEventLoopDriver

# Upstream's idle leak check (invariant_checker.py), strict by default.
STRICT_IDLE_CHECK = "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"


def strict_idle_check_off() -> contextlib.AbstractContextManager[Any]:
    """Upstream's strict idle check off: it reads memory co-tenants hold as a leak (kvcached's
    integration turns it off)."""
    return mock.patch.dict(os.environ, {STRICT_IDLE_CHECK: "0"})


# Idle iterations once every request ended, before the one with upstream's strict idle check.
WIND_DOWN_ITERATIONS = 10
# Iterations at most per seed; the co-tenants give everything back at this iteration.
MAX_ITERATIONS = 400
CO_TENANTS_LEAVE_AT = 150
# Tokens of a prompt's shared prefix, and the token ids each prefix and prompt draws from.
PREFIX_TOKENS = (8, 24, 40)
FIRST_TOKEN = 1000
# What the simulated collectives are recorded as: (function, group, reduce op, shape, dtype).
Collective = tuple[str, str, str, tuple[int, ...], str]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce")


@dataclass(frozen=True)
class SimRequest:
    rid: str
    arrives_at: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    aborted_at: int | None = None
    # Its output constrained by a grammar (a JSON schema of its own), which each rank compiles
    # at its own pace (sim_grammar.py).
    grammar: bool = False


@dataclass(frozen=True)
class Quarantine:
    """Rank 1's GPU sets aside `tokens` of the pages it has not mapped, for a window of iterations."""

    tokens: int
    first: int
    last: int

    def applies(self, iteration: int) -> bool:
        return self.first <= iteration <= self.last


@dataclass(frozen=True)
class SimPlan:
    seed: int
    page_size: int
    kv_tokens: int
    chunked_prefill_size: int
    mamba: bool
    hicache: bool
    requests: tuple[SimRequest, ...]
    # Per rank: the most tokens its co-tenants hold at once (0: none), read afresh at every reading.
    co_tenants: tuple[int, ...]
    # With HiCache: the chance that a copy in flight lands before an iteration, per rank (1.0: at
    # once). Each rank's copies land on its own schedule, as two GPUs' copy streams do.
    copy_landing: tuple[float, ...] = (1.0, 1.0)
    # Per rank: the tokens it holds mapped at the start (the decode credit's reading).
    mapped: tuple[int, ...] = (0, 0)
    # The loop both ranks run: event_loop_overlap (the default server's) or event_loop_normal.
    overlap: bool = False
    # A PD prefill server (the disaggregated prefill loop) instead of a plain one.
    pd_prefill: bool = False
    # --enable-mixed-chunk: a prefill chunk runs in one batch with the running decode requests.
    mixed_chunk: bool = False
    # The ranks of the one TP group (two; three in some seeds): every per-rank tuple has as many.
    ranks: int = 2
    # Rank 1's GPU sets `tokens` of its unmapped pages aside from iteration `first` to `last` (None:
    # never): its real reading drops, its own one does not.
    quarantine: Quarantine | None = None

    def summary(self) -> str:
        aborted = sum(r.aborted_at is not None for r in self.requests)
        return (
            f"page {self.page_size}, {self.kv_tokens} KV tokens, chunk {self.chunked_prefill_size},"
            f" mamba {self.mamba}, hicache {self.hicache}, {len(self.requests)} requests ({aborted} aborted),"
            f" {self.ranks} ranks,"
            f" co-tenants up to {' / '.join(map(str, self.co_tenants))} tokens,"
            f" copies landing per iteration {' / '.join(f'{p:.2f}' for p in self.copy_landing)},"
            f" held mapped {' / '.join(map(str, self.mapped))} tokens,"
            f" {'event_loop_overlap' if self.overlap else 'event_loop_normal'}"
            + (", PD prefill" if self.pd_prefill else "")
            + (", mixed chunk" if self.mixed_chunk else "")
            + (f", {n} grammar requests" if (n := sum(r.grammar for r in self.requests)) else "")
            + (
                f", rank 1 quarantines {q.tokens} tokens in iterations {q.first}-{q.last}"
                if (q := self.quarantine)
                else ""
            )
        )

    def harness_config(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "kv_tokens": self.kv_tokens,
            "chunked_prefill_size": self.chunked_prefill_size,
            "mamba": self.mamba,
            "hicache": self.hicache,
            "auto_complete_events": self.copy_landing == (1.0, 1.0),
            "enable_overlap": self.overlap,
            "pd_prefill": self.pd_prefill,
            "enable_mixed_chunk": self.mixed_chunk,
        }


def plan(seed: int) -> SimPlan:
    """Everything a seed decides that both ranks share (and each rank's co-tenants' bound)."""
    rng = random.Random(seed)
    page_size = rng.choice((1, 1, 4))
    kv_tokens = rng.choice((192, 256, 384, 512))
    prefixes = [
        list(range(FIRST_TOKEN + 100 * g, FIRST_TOKEN + 100 * g + rng.choice(PREFIX_TOKENS)))
        for g in range(3)
    ]
    requests = []
    arrives_at = 0
    for i in range(rng.randint(3, 14)):
        if rng.random() < 0.3:
            arrives_at += rng.randint(1, 12)  # a gap, idle iterations too
        own = list(range(FIRST_TOKEN + 500 + 40 * i, FIRST_TOKEN + 500 + 40 * i + rng.randint(1, 36)))
        prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + own
        aborted_at = arrives_at + rng.randint(0, 8) if rng.random() < 0.15 else None
        requests.append(SimRequest(f"s{i:02d}", arrives_at, tuple(prompt), rng.randint(1, 12), aborted_at))
    largest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    co_tenant_room = max(0, kv_tokens - largest - 16)
    co_tenants = tuple(rng.choice(_co_tenant_bounds(co_tenant_room)) for _ in range(2))
    mamba = rng.random() < 0.3
    if mamba:
        page_size = 1  # the Mamba component's no_buffer tree takes pages of one token
    hicache = rng.random() < 0.3
    delayed = hicache and rng.random() < 0.7
    landing = (rng.choice(LANDING_CHANCES), rng.choice(LANDING_CHANCES)) if delayed else (1.0, 1.0)
    requests = _with_grammars(seed, requests)
    two_ranks = SimPlan(
        seed=seed,
        page_size=page_size,
        kv_tokens=kv_tokens,
        chunked_prefill_size=rng.choice((16, 32, 64, 256)),
        mamba=mamba,
        hicache=hicache,
        requests=tuple(requests),
        co_tenants=co_tenants,
        copy_landing=landing,
        # Held-mapped memory, the decode credit's reading, per rank (drawn apart, as the loop is).
        mapped=_mapped(seed, kv_tokens),
        # Drawn apart, so that what the seed decides above is the same with either loop.
        overlap=random.Random(f"{seed}-loop").random() < 0.5,
        **_server_kind(seed, mamba),
        quarantine=_quarantine(seed, page_size, kv_tokens),
    )
    return _with_a_third_rank(two_ranks, co_tenant_room, delayed)


# With HiCache copies landing late: the chance a rank's copy in flight lands before an iteration.
LANDING_CHANCES = (0.2, 0.5, 0.9)


def _co_tenant_bounds(room: int) -> tuple[int, ...]:
    """The most a rank's co-tenants may hold at once: none, or part or all of the room left."""
    return (0, room // 4, room // 2, room)


def _with_grammars(seed: int, requests: list[SimRequest]) -> list[SimRequest]:
    """In some seeds about half the requests ask for a grammar (drawn apart, so that the traffic
    is the same either way)."""
    rng = random.Random(f"{seed}-grammar")
    if rng.random() >= 0.2:
        return requests
    return [replace(r, grammar=rng.random() < 0.5) for r in requests]


# Per rank, how many iterations after its arrival a request's grammar is let compile (None: never,
# so upstream times it out on that rank, after sim_grammar.MAX_POLL_ITERATIONS polls).
COMPILE_DELAYS = (0, 0, 1, 2, 5, 9, None)


def _compile_iterations(sim: SimPlan, rank: int) -> dict[str, int | None]:
    """This rank's iteration at which each grammar request's compilation may finish."""
    rng = random.Random(f"{sim.seed}-grammar-{rank}")
    compile_at: dict[str, int | None] = {}
    for request in sim.requests:
        if request.grammar:
            delay = rng.choice(COMPILE_DELAYS)
            compile_at[request.rid] = None if delay is None else request.arrives_at + delay
    return compile_at


def _with_a_third_rank(plan: SimPlan, co_tenant_room: int, delayed: bool) -> SimPlan:
    """In some seeds the group has a third rank (drawn apart, so that what the first two do is
    the same either way): every reduction then has a rank between the least and the most. Not
    with a Mamba pool: the harness's Mamba state (a conv dimension of 32) does not split three
    ways, as no real model's would."""
    rng = random.Random(f"{plan.seed}-third-rank")
    if rng.random() >= 0.1 or plan.mamba:
        return plan
    return replace(
        plan,
        ranks=3,
        co_tenants=(*plan.co_tenants, rng.choice(_co_tenant_bounds(co_tenant_room))),
        copy_landing=(*plan.copy_landing, rng.choice(LANDING_CHANCES) if delayed else 1.0),
        mapped=(*plan.mapped, rng.choice(_mapped_bounds(plan.kv_tokens))),
    )


def _server_kind(seed: int, mamba: bool) -> dict[str, bool]:
    """A PD prefill server in some seeds, mixed chunked prefill in others (drawn apart). No PD
    prefill with a Mamba pool: the harness's model is a Llama config beside Mamba pools, which
    upstream's KV sender reads as a hybrid model's config (full_attention_layer_ids)."""
    draw = random.Random(f"{seed}-server").random()
    return {"pd_prefill": draw < 0.15 and not mamba, "mixed_chunk": 0.15 <= draw < 0.3}


def _quarantine(seed: int, page_size: int, kv_tokens: int) -> Quarantine | None:
    """In some seeds rank 1 quarantines a few pages (or most of its pool) for a while."""
    rng = random.Random(f"{seed}-quarantine")
    if rng.random() >= 0.15:
        return None
    tokens = rng.choice((page_size, 4 * page_size, kv_tokens // 2, kv_tokens - 16))
    first = rng.randint(0, 40)
    return Quarantine(tokens, first, first + rng.choice((2, 8, 30)))


def _mapped(seed: int, kv_tokens: int) -> tuple[int, int]:
    """The tokens each rank holds mapped at the start: none, some or all of its pool."""
    rng = random.Random(f"{seed}-mapped")
    first, second = (rng.choice(_mapped_bounds(kv_tokens)) for _ in range(2))
    return first, second


def _mapped_bounds(kv_tokens: int) -> tuple[int, ...]:
    """What a rank may hold mapped at the start: none, some or all of its pool."""
    return (0, kv_tokens // 8, kv_tokens // 2, kv_tokens)


def _co_tenant_readings(seed: int, rank: int, most: int) -> Iterator[int]:
    """What this rank's co-tenants hold, a new reading each time (kvcached's physical reading
    drifts between any two reads), from this rank's own generator."""
    rng = random.Random(f"{seed}-co-tenants-{rank}")
    while True:
        yield rng.randint(0, most)


ONE_RANK_GROUP = "this rank alone"


def _group_name(group: Any) -> str:
    """The group's name, alike on every rank for a group they share. A group of this rank alone
    is named by that (each rank's own object has its own name, and upstream reduces over it where
    a dimension has size 1, e.g. 0.5.20's PD poll over attention CP)."""
    if group is None:
        return "default"
    if isinstance(group, dist.ProcessGroup) and group.size() == 1:
        return ONE_RANK_GROUP
    return str(getattr(group, "group_name", type(group).__name__))


@contextlib.contextmanager
def recording_collectives(record: list[Collective]) -> Iterator[None]:
    """Wrap torch.distributed's collectives for the block: each call the scheduler's loop makes
    (on its thread; not those of upstream's rank-consensus checker, which compares on a thread and
    groups of its own) is appended to `record` (function, group, reduce op, shape, dtype) before it
    runs."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        def collective(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
            if name == "all_gather" and args and isinstance(args[0], list):
                tensor = args[1] if len(args) > 1 else kwargs.get("tensor")
            op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
            if threading.current_thread().name != LOOP_THREAD_NAME:
                return real(*args, **kwargs)
            record.append(
                (
                    name,
                    _group_name(kwargs.get("group")),
                    str(op) if op is not None else "",
                    tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else (),
                    str(tensor.dtype) if isinstance(tensor, torch.Tensor) else "",
                )
            )
            return real(*args, **kwargs)

        return collective

    for name, real in saved.items():
        setattr(dist, name, wrap(name, real))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


@dataclass
class RankRecord:
    """What one rank saw of a seed: per iteration its batch and its collectives."""

    iterations: list[tuple[str | None, tuple[str, ...], int]] = field(default_factory=list)
    collectives: list[list[Collective]] = field(default_factory=list)
    failure: str | None = None
    # Decode steps the agreed credit covered (run without a vote).
    credited_steps: int = 0
    # Requests that ended without a reason, and the harness's leak report once idle.
    unfinished: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    # Prefill rounds this rank read as DIVERGED (put back), and the agreement's votes it made.
    divergences: int = 0
    votes: int = 0
    # Iterations that began with a request waiting for its grammar, and the grammar requests
    # upstream gave up (timed out) and aborted.
    grammar_waits: int = 0
    grammar_timeouts: int = 0


def _aborted_rids(h: sh.Harness) -> set[str]:
    """The requests the scheduler reported to the tokenizer as aborted (while queued, retracted,
    rejected): they end there, with the abort's reason, and never finish in the tree."""
    from sglang.srt.managers.io_struct import AbortReq

    outputs = h.scheduler.ipc_channels.send_to_tokenizer.outputs
    return {str(output.rid) for output in outputs if isinstance(output, AbortReq)}


def _ended(h: sh.Harness, reqs: dict[str, Any]) -> set[str]:
    """The requests that ended: finished with a reason, or reported aborted."""
    return {rid for rid, req in reqs.items() if req.finished_reason is not None} | _aborted_rids(h)


def _land_copies(h: sh.Harness, rng: random.Random, chance: float) -> None:
    """Each device copy in flight on this rank lands now with `chance` (the CPU stand-ins' events
    stay pending until then)."""
    for event in getattr(h.device, "events", ()):
        if getattr(event, "recorded", False) and not event.done and rng.random() < chance:
            event.done = True


def _abort(driver: EventLoopDriver, rid: str) -> None:
    """A client's abort, as the tokenizer sends it: received by the next iteration."""
    from sglang.srt.managers.io_struct import AbortReq

    driver.deliver(AbortReq(rid=rid))


def _recorded_step(driver: EventLoopDriver, made: list[Collective], record: RankRecord) -> Iteration:
    """One loop iteration, its batch and the collectives it made appended to `record`."""
    before = len(made)
    it = driver.step()
    record.iterations.append((it.forward_mode, it.rids, it.extend_tokens))
    record.collectives.append(made[before:])
    return it


def _quarantine_on_rank_1(h: sh.Harness, quarantine: Quarantine, iteration: Callable[[], int]) -> None:
    """Rank 1's GPU sets pages aside while the quarantine applies: its real reading drops on this
    rank alone, between any two votes, as kvcached's quarantine of pages whose mapping failed does."""
    assert h.physical is not None
    h.physical.quarantine(lambda: quarantine.tokens if quarantine.applies(iteration()) else 0)


def run_rank(h: sh.Harness, rank: int, sim: SimPlan) -> dict[str, Any]:
    """One rank's run of a seed (a MultiRoundScenario of test_rank_agreement.run_two_ranks)."""
    record = RankRecord()
    now = [0]
    if rank == 1 and sim.quarantine is not None:
        _quarantine_on_rank_1(h, sim.quarantine, lambda: now[0])
    driver = (OverlapEventLoopDriver if sim.overlap else EventLoopDriver)(h)
    assert h.physical is not None, "the simulation needs the kvcached-shaped pool (elastic)"
    if sim.co_tenants[rank]:
        h.physical.drift(_co_tenant_readings(sim.seed, rank, sim.co_tenants[rank]))
    else:
        h.physical.take(0)
    # Memory this rank holds mapped, which no co-tenant can take (kvcached's free blocks on its
    # mapped pages): the decode credit's reading. It only shrinks as the pool allocates from it.
    h.physical.hold_mapped(sim.mapped[rank])
    copies = random.Random(f"{sim.seed}-copies-{rank}")
    compile_at = _compile_iterations(sim, rank)
    grammars = sim_grammar.install(h, sim.ranks, rank) if compile_at else None
    agreement = h.scheduler._prefill_agreement
    covers = agreement.covers_decode_step

    def counted_cover(rows: int) -> bool:
        credited = bool(covers(rows))
        record.credited_steps += credited
        return credited

    agreement.covers_decode_step = counted_cover
    reqs: dict[str, Any] = {}
    made: list[Collective] = []
    last_arrival = max(r.arrives_at for r in sim.requests)
    try:
        # While co-tenants hold memory the pool's real free space is short of its total, which
        # upstream's idle check (strict by default) reads as a leak; kvcached's own SGLang
        # integration turns that check off. Off while they may hold memory; on for the final idle
        # iteration, after they left.
        with recording_collectives(made), strict_idle_check_off():
            for iteration in range(MAX_ITERATIONS):
                now[0] = iteration
                if iteration == CO_TENANTS_LEAVE_AT:
                    h.physical.take(0)
                _land_copies(h, copies, sim.copy_landing[rank] if iteration < CO_TENANTS_LEAVE_AT else 1.0)
                for request in sim.requests:
                    if request.arrives_at == iteration:
                        req = h.make_req(
                            list(request.prompt), rid=request.rid, max_new_tokens=request.max_new_tokens
                        )
                        reqs[request.rid] = req
                        if request.grammar:
                            req.sampling_params.json_schema = sim_grammar.schema_of(request.rid)
                            sim_grammar.submit(h, req)
                        else:
                            h.scheduler._add_request_to_queue(req)
                if grammars is not None:
                    for rid, at in compile_at.items():
                        if at == iteration:
                            grammars.let_compile(sim_grammar.schema_of(rid))
                    record.grammar_waits += h.scheduler.grammar_manager.has_waiting_grammars()
                aborting = [r.rid for r in sim.requests if r.aborted_at == iteration]
                if aborting:
                    ended = _ended(h, reqs)
                    for rid in aborting:
                        if rid not in ended:
                            _abort(driver, rid)
                it = _recorded_step(driver, made, record)
                done = iteration >= last_arrival and _ended(h, reqs) >= set(reqs)
                if done and it.forward_mode is None:
                    break
            # Wind down: the co-tenants leave and every copy in flight lands; the next iterations
            # reap the copies' acks (which unlock their tree nodes), the last one with upstream's
            # strict idle check.
            h.physical.take(0)
            _land_copies(h, copies, 1.0)
            now[0] = MAX_ITERATIONS  # no quarantine outlives the traffic
            for strict in ("0",) * WIND_DOWN_ITERATIONS + ("1",):
                with mock.patch.dict(os.environ, {STRICT_IDLE_CHECK: strict}):
                    _recorded_step(driver, made, record)
    except Exception as error:  # a rank's loop raised: the seed fails, with where and what
        record.failure = (
            f"iteration {len(record.iterations)}: {type(error).__name__}: {str(error).splitlines()[0]}"
        )
    finally:
        if grammars is not None:
            grammars.open_every_gate()  # no compilation outlives the seed
    record.unfinished = sorted(set(reqs) - _ended(h, reqs))
    record.divergences = int(h.scheduler.num_prefill_divergences)
    record.grammar_timeouts = sum(sim_grammar.timed_out(reqs[rid]) for rid in compile_at if rid in reqs)
    record.votes = int(agreement.votes)
    if record.failure is None:
        record.leaks = (
            driver.idle_leaks if driver.idle_leaks is not None else ["never fully idle at an on_idle"]
        )
    return asdict(record)


@dataclass(frozen=True)
class SeedVerdict:
    seed: int
    iterations: int
    collectives: int
    credited_steps: int
    failures: tuple[str, ...]
    # Prefill rounds both ranks read as DIVERGED, and whether the seed ended with both stopping
    # by name (PrefillRankDivergence at the same iteration).
    diverged_rounds: int = 0
    stopped_by_name: bool = False
    # Rank 0's iterations that began with a grammar waiting, and its grammar requests timed out.
    grammar_waits: int = 0
    grammar_timeouts: int = 0


# What a rank of a group stops with where the ranks' states have parted, alike on every rank.
STOPS_BY_NAME = ("PrefillRankDivergence", "RankVotesParted")


def _stop_name(failure: str | None) -> str | None:
    """The name a rank stopped with (`iteration N: Name: message`), where it is one of
    STOPS_BY_NAME."""
    parts = (failure or "").split(": ")
    return parts[1] if len(parts) > 2 and parts[1] in STOPS_BY_NAME else None


def judge(seed: int, ranks: dict[int, dict[str, Any]]) -> SeedVerdict:
    """What the ranks' records of a seed show, one line per failed check, each rank set against
    rank 0. Every rank stopping by the same name at the same vote is the safety net working, not a
    failure (where the ranks parted they may stop an iteration apart: a rank that retracted made
    no vote in it); one rank stopping alone is one."""
    failures: list[str] = []
    r0 = ranks[0]
    stop = _stop_name(r0["failure"])
    stopped_by_name = stop is not None and all(
        _stop_name(r["failure"]) == stop and r["votes"] == r0["votes"] for r in ranks.values()
    )
    if not stopped_by_name:
        for rank, r in ranks.items():
            if r["failure"]:
                failures.append(f"rank {rank} raised at {r['failure']}")
            if r["unfinished"]:
                failures.append(f"rank {rank}: requests never finished: {r['unfinished']}")
            if r["leaks"]:
                failures.append(f"rank {rank}: leaked once idle: {r['leaks']}")
        for rank, r in ranks.items():
            if rank != 0:
                failures += _parted_from_rank_0(r0, r, rank)
    return SeedVerdict(
        seed,
        len(r0["iterations"]),
        sum(len(c) for c in r0["collectives"]),
        r0["credited_steps"],
        tuple(failures),
        diverged_rounds=r0["divergences"],
        stopped_by_name=stopped_by_name,
        grammar_waits=r0["grammar_waits"],
        grammar_timeouts=r0["grammar_timeouts"],
    )


def _parted_from_rank_0(r0: dict[str, Any], r: dict[str, Any], rank: int) -> list[str]:
    """Where one rank's record differs from rank 0's: the first difference of its iterations and
    of its collectives, and each count that differs."""
    failures: list[str] = []
    for i, (a, b) in enumerate(zip(r0["iterations"], r["iterations"], strict=False)):
        if a != b:
            failures.append(f"iteration {i + 1}: rank 0 ran {a}, rank {rank} ran {b}")
            break
    else:
        ran = len(r0["iterations"]), len(r["iterations"])
        if ran[0] != ran[1] and not (r0["failure"] or r["failure"]):
            failures.append(f"iterations run: rank 0 {ran[0]}, rank {rank} {ran[1]}")
    for i, (a, b) in enumerate(zip(r0["collectives"], r["collectives"], strict=False)):
        if a != b:
            failures.append(f"iteration {i + 1}: rank 0's collectives {a}, rank {rank}'s {b}")
            break
    counts = {
        "credited_steps": "credited decode steps",
        "grammar_timeouts": "grammars timed out",
        "divergences": "diverged rounds read",
    }
    for key, what in counts.items():
        if r0[key] != r[key]:
            failures.append(f"{what}: rank 0 {r0[key]}, rank {rank} {r[key]}")
    return failures


def replay_command(seed: int) -> str:
    """The one line that runs this seed alone, as the failing run did."""
    test = Path(__file__).resolve().parent / "test_simulation.py"
    return f"CARRY_SIM_SEEDS={seed} {shlex.quote(sys.executable)} -m pytest {shlex.quote(str(test))} -q"


def parse_seeds(text: str) -> list[int]:
    """`0-199`, `7`, `3,9,40-45`: the seeds named."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, last = part.partition("-")
        seeds += list(range(int(first), int(last or first) + 1))
    return seeds
