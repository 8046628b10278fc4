"""A rank-local pool where a mode allocates from it at a point no vote covers is refused at
start-up, by name (series entry "Scheduler: refuse a rank-local pool where a mode allocates
outside the votes", sgl-project/sglang#34676).

The agreement makes the ranks of a group admit, evict and retract by the same ledger, but only at
the points it votes on. Two modes allocate from a rank-local pool elsewhere:
- a PD-disaggregated decode server (`--disaggregation-mode decode`) preallocates KV for incoming
  transfers in its own event loops, which never make a prefill round, from each rank's drifting
  reading; upstream requires identical admission there (the sizes of later polling collectives
  follow it);
- `--mamba-radix-cache-strategy extra_buffer_lazy` allocates Mamba ping-pong slots after the
  decode vote, so a slot one rank misses alone changes that rank's tracking only.
Each is refused when the pool it allocates from is rank-local and more than one rank schedules a
batch together; one rank alone has nothing to agree with and runs as before. Two forked gloo
ranks with distinct group objects, the pool's readings drifting on each.

Expected: the two-rank tests FAIL without the entry (the scheduler starts, the agreement built)
and PASS with it, both ranks refusing alike; the one-rank test passes either way.
"""

from __future__ import annotations

import types
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from sglang.srt.disaggregation.utils import DisaggregationMode
from test_rank_agreement import MultiRoundScenario, TwoRanks, counted_alike, run_two_ranks

LAZY_MAMBA = types.SimpleNamespace(mamba=types.SimpleNamespace(enable_mamba_extra_buffer_lazy=True))


def _start_up(h: sh.Harness) -> dict[str, Any]:
    """What the scheduler's start-up makes of the agreement (it reads the property in __init__):
    the refusal's message, or that it started."""
    sched = h.scheduler
    sched.__dict__.pop("_prefill_agreement", None)
    try:
        agreement = sched._prefill_agreement
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None, "agreed": agreement is not None}


def _started_as(mode: DisaggregationMode) -> MultiRoundScenario:
    """The start-up of a server of this disaggregation mode, on the scenario's harness."""

    def start(h: sh.Harness, rank: int) -> dict[str, Any]:
        sched = h.scheduler
        saved, sched.disaggregation_mode = sched.disaggregation_mode, mode
        try:
            return _start_up(h)
        finally:
            sched.disaggregation_mode = saved

    return start


_pd_decode = _started_as(DisaggregationMode.DECODE)
_pd_prefill = _started_as(DisaggregationMode.PREFILL)


def _mamba_pool(h: sh.Harness) -> Any:
    """What hands out the Mamba slots: the slot allocator where the line has one, else the pool."""
    pools = h.req_to_token_pool
    pool = getattr(pools, "mamba_allocator", None) or getattr(pools, "mamba_pool", None)
    assert pool is not None, "the harness built no Mamba pool"
    return pool


def _lazy_ping_pong(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The Mamba pool rank-local (as kvcached's Mamba allocator is), counted alike on every rank."""
    pool = _mamba_pool(h)
    pool.rank_local_capacity = True
    counted_alike(pool)
    with mock.patch("sglang.srt.managers.scheduler.get_exec", return_value=LAZY_MAMBA):
        return _start_up(h)


def _eager_ping_pong(h: sh.Harness, rank: int) -> dict[str, Any]:
    """extra_buffer (not lazy) with the same rank-local KV pool: its slots are allocated with the
    request, inside the voted round; nothing to refuse."""
    return _start_up(h)


def _speculative(h: sh.Harness, rank: int) -> dict[str, Any]:
    """`--speculative-algorithm EAGLE`: its draft and verify steps allocate after the decode vote,
    and a miss there cannot be given back (upstream's crash, group-wide)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    spec = types.SimpleNamespace(speculative_algorithm="EAGLE")
    with (
        mock.patch.object(h.scheduler, "spec_algorithm", SpeculativeAlgorithm.from_string("EAGLE")),
        mock.patch("sglang.srt.managers.scheduler.get_spec", return_value=spec),
    ):
        return _start_up(h)


def _dllm(h: sh.Harness, rank: int) -> dict[str, Any]:
    """`--dllm-algorithm`: get_new_batch_dllm allocates its batches with no vote and no unwind."""
    exec_args = types.SimpleNamespace(
        dllm=types.SimpleNamespace(dllm_algorithm="LowConfidence"),
        mamba=types.SimpleNamespace(enable_mamba_extra_buffer_lazy=False),
    )
    with (
        mock.patch.object(h.scheduler, "dllm_config", object()),
        mock.patch("sglang.srt.managers.scheduler.get_exec", return_value=exec_args),
    ):
        return _start_up(h)


def _hicache_buffer_mode(h: sh.Harness, rank: int) -> dict[str, Any]:
    """`--hicache-host-memory-mode buffer_only`: the buffer pipeline's load-backs allocate device
    memory outside the agreed load-back."""
    memory = types.SimpleNamespace(hicache_host_memory_mode="buffer_only")
    with (
        mock.patch.object(h.scheduler, "enable_hierarchical_cache", True),
        mock.patch("sglang.srt.managers.scheduler.get_memory", return_value=memory),
    ):
        return _start_up(h)


def _in_groups(attention_tp_spans_both: bool, attention_cp_spans_both: bool) -> MultiRoundScenario:
    """A PD decode server's start-up where the attention-TP and attention-CP groups span both ranks
    or this rank alone (the TP group spans both either way): context parallelism puts both ranks
    in one attention-CP group, DP attention each in attention groups of its own."""

    def start(h: sh.Harness, rank: int) -> dict[str, Any]:
        sched = h.scheduler
        both, alone = sched.attn_tp_cpu_group, sched.attn_cp_cpu_group  # the harness's TP topology
        groups = {
            "attn_tp_cpu_group": both if attention_tp_spans_both else alone,
            "attn_cp_cpu_group": both if attention_cp_spans_both else alone,
        }
        with mock.patch.multiple(sched, **groups):
            return _pd_decode(h, rank)

    return start


SCENARIOS: dict[str, MultiRoundScenario] = {
    "tp_pd_decode": _pd_decode,
    "tp_pd_prefill": _pd_prefill,
    "tp_lazy_ping_pong": _lazy_ping_pong,
    "tp_eager_ping_pong": _eager_ping_pong,
    "tp_speculative": _speculative,
    "tp_dllm": _dllm,
    "tp_hicache_buffer_mode": _hicache_buffer_mode,
    "cp_pd_decode": _in_groups(attention_tp_spans_both=False, attention_cp_spans_both=True),
    "dp_attention_pd_decode": _in_groups(attention_tp_spans_both=False, attention_cp_spans_both=False),
}
CONFIGS = {
    "tp_lazy_ping_pong": {"mamba": True, "ping_pong": True},
    "tp_eager_ping_pong": {"mamba": True, "ping_pong": True},
}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    return run_two_ranks(list(SCENARIOS), SCENARIOS, {}, CONFIGS)


def test_a_pd_decode_server_with_a_rank_local_pool_is_refused_by_name(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_pd_decode")
    assert ranks[0] == ranks[1]
    refused = ranks[0]["refused"]
    assert refused is not None and "--disaggregation-mode decode" in refused, ranks[0]
    assert "with 2 ranks scheduling together" in refused


def test_lazy_mamba_ping_pong_slots_from_a_rank_local_pool_are_refused_by_name(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_lazy_ping_pong")
    assert ranks[0] == ranks[1]
    refused = ranks[0]["refused"]
    assert refused is not None and "--mamba-radix-cache-strategy extra_buffer_lazy" in refused, ranks[0]


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("tp_speculative", "--speculative-algorithm EAGLE"),
        ("tp_dllm", "--dllm-algorithm LowConfidence"),
        ("tp_hicache_buffer_mode", "--hicache-host-memory-mode buffer_only"),
    ],
)
def test_modes_allocating_outside_the_votes_are_refused_at_start_up_by_name(
    two_ranks: TwoRanks, name: str, flag: str
) -> None:
    ranks = two_ranks.scenario(name)
    assert ranks[0] == ranks[1]
    refused = ranks[0]["refused"]
    assert refused is not None and flag in refused and "with 2 ranks scheduling together" in refused, ranks[0]


def test_the_ranks_counted_are_those_that_schedule_together_not_the_tp_group(two_ranks: TwoRanks) -> None:
    """The refusal counts the ranks of a batch's attention groups, attention-TP times attention-CP:
    under context parallelism both ranks schedule together (refused); under DP attention each
    rank schedules alone although its TP group spans both (started)."""
    cp = two_ranks.scenario("cp_pd_decode")
    assert cp[0] == cp[1] and "with 2 ranks scheduling together" in (cp[0]["refused"] or ""), cp
    dp = two_ranks.scenario("dp_attention_pd_decode")
    assert dp[0] == dp[1] == {"refused": None, "agreed": True}, dp


def test_a_pd_prefill_server_and_eager_ping_pong_slots_start(two_ranks: TwoRanks) -> None:
    """A PD prefill server admits in prefill rounds, which the ranks agree on; eager ping-pong
    slots come with the admitted request. Both start, with the agreement."""
    for name in ("tp_pd_prefill", "tp_eager_ping_pong"):
        ranks = two_ranks.scenario(name)
        assert ranks[0] == ranks[1] == {"refused": None, "agreed": True}, (name, ranks)


def test_one_rank_alone_is_never_refused() -> None:
    with sh.build_harness(elastic=True) as h:
        assert _pd_decode(h, 0) == {"refused": None, "agreed": True}
    with sh.build_harness(elastic=True, mamba=True, ping_pong=True) as h:
        assert _lazy_ping_pong(h, 0) == {"refused": None, "agreed": True}
    with sh.build_harness(elastic=True) as h:
        for mode in (_speculative, _dllm, _hicache_buffer_mode):
            assert mode(h, 0) == {"refused": None, "agreed": True}, mode.__name__


def test_every_refusal_is_made_at_start_up() -> None:
    """Scheduler.__init__ builds the agreement before the scheduler serves, so a refused
    configuration stops start-up on every rank alike, not the first round that reaches a vote."""
    import inspect

    from sglang.srt.managers.scheduler import Scheduler

    source = inspect.getsource(Scheduler.__init__)
    assert "self._prefill_agreement" in source
    assert source.index("self._prefill_agreement") < source.index("self.is_initializing = False")
