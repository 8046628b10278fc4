"""What a run's server is given and sent, one Scenario per kind of run: HICACHE (misses injected
while a HiCache load is in flight), NATURAL (upstream's own allocation miss, no hook) and LFM2
(the hybrid LFM2 under HICACHE's pool, its Mamba state loaded back). Each names its flags, its
traffic (a planner of traffic.py), where its misses come from, its model and the first sglang
line it can run on; GDN is the gated-delta-net hybrid under LFM2's pool and traffic, and
NATURAL_HICACHE is NATURAL with HiCache on. A new kind of run is a Scenario here and its rows in
plan.CPU_PLAN."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .traffic import (
    CONCURRENCY,
    NATURAL_SHORT_REQUESTS,
    Request,
    plan_growing_traffic,
    plan_natural_traffic,
    plan_parked_traffic,
    plan_traffic,
)

# The device KV pool (--max-total-tokens) and the largest prefill chunk (--chunked-prefill-size).
MAX_TOTAL_TOKENS = 1024
CHUNK_TOKENS = 1024
# The device KV pool, its paging, the running requests and the prefill chunk of the injected runs.
SMALL_POOL_FLAGS = (
    "--max-total-tokens",
    str(MAX_TOTAL_TOKENS),
    "--page-size",
    "1",
    "--max-running-requests",
    "8",
    "--chunked-prefill-size",
    str(CHUNK_TOKENS),
)
# The pool, cache and scheduling flags of the injected runs: native HiCache (write-through) over a
# small device pool, so HICACHE's traffic (traffic.plan_traffic) evicts to host and loads
# back.
HICACHE_FLAGS = (
    "--enable-hierarchical-cache",
    "--hicache-write-policy",
    "write_through",
    "--hicache-ratio",
    "8",
    *SMALL_POOL_FLAGS,
)
# Natural runs: upstream's own prefill allocation miss, no hook (sgl-project/sglang #30743: a
# chunked prefill continued when the budget is spent). One long prompt is chunked; short prompts
# arrive while it is (traffic.plan_natural_traffic). Under shortest-prefill-first,
# `shortest_prefill_chunk_limit` (managers/schedule_policy.py:418-438 in 0.5.23) caps each
# continuation chunk to leave room for the shorter waiting requests, which are then admitted
# beside it with their new tokens reserved; a prefill runs before any decode
# (managers/scheduler.py:3992-3994), so they keep their reservation while the chunks go on, until
# the budget's total is spent. Then `available_chunk_tokens` (mem_cache/prefill_budget.py:142-145:
# "single-pool continuation must make progress") hands the continuation a whole chunk anyway, more
# than the pool holds free, and `alloc_token_slots` raises "Out of memory ... Try to allocate 128
# tokens" (mem_cache/allocation.py:160-170), which kills the scheduler. Float32, so the patched
# outputs can be compared exactly (in bf16 a re-chunked prompt can flip a greedy near-tie).
NATURAL_POOL_TOKENS = 3300
# The natural control's pool: the same traffic never misses in it.
NATURAL_ROOMY_POOL_TOKENS = 16384


def natural_flags(pool_tokens: int) -> tuple[str, ...]:
    return (
        "--schedule-policy",
        "shortest-prefill-first",
        "--max-total-tokens",
        str(pool_tokens),
        "--chunked-prefill-size",
        "128",
        "--max-running-requests",
        "64",
        "--page-size",
        "1",
        "--dtype",
        "float32",
    )


@dataclass(frozen=True)
class Scenario:
    """What a run's server is given and sent: its pool, cache and scheduling flags (the control
    run's may differ), the traffic (waves) and how many requests are in flight at once. Where the
    misses come from: the hook (`injects`) or the server itself."""

    name: str
    flags: tuple[str, ...]
    control_flags: tuple[str, ...]
    plan: Callable[[], list[list[Request]]]
    concurrency: int
    injects: bool
    # A control must see host hits and loads (the traffic's prefixes come back from host).
    control_loads_from_host: bool
    # The first sglang line whose code has what the scenario relies on.
    first_line: str = "0.5.20"
    # The model it serves (MODELS), and the flags of a run that recomputes every prompt (no
    # prefix cache, no HiCache): the reference a control's outputs must equal (None: no such run).
    model: str = "dense"
    recompute_flags: tuple[str, ...] | None = None
    # The model has a Mamba state: a control must load some back from host, and a patched run
    # must land no load copy in a Mamba slot after that slot was released.
    mamba_state: bool = False
    # The model is a gated delta net: its servers load the GDN stand-ins (ci/e2e/cpu/carry_e2e_gdn.py).
    gdn_kernels: bool = False
    # A patched run must release a parked chunk (series entry 0015) on every rank, or it showed
    # nothing of what it is for.
    parks_a_chunk: bool = False
    # Its misses are Mamba checkpoints that find no slot: pristine must die of the Mamba
    # assertion, and a patched run must recover such misses (series entry 0017) on every rank.
    mamba_checkpoints: bool = False

    def keys(self) -> set[str]:
        return {request.key for wave in self.plan() for request in wave}


HICACHE = Scenario("hicache", HICACHE_FLAGS, HICACHE_FLAGS, plan_traffic, CONCURRENCY, True, True)
# The control serves the same traffic from a pool large enough not to miss.
NATURAL = Scenario(
    "natural",
    natural_flags(NATURAL_POOL_TOKENS),
    natural_flags(NATURAL_ROOMY_POOL_TOKENS),
    plan_natural_traffic,
    NATURAL_SHORT_REQUESTS + 1,
    False,
    False,
    # shortest-prefill-first and its chunk limit came in 0.5.21.
    first_line="0.5.21",
)
# NATURAL with HiCache on (write-through, a host pool of four times the device pool): the same
# overcommitted chunk, unwound by the series, while the short requests decode in a full pool. The
# parked chunk keeps its prefix, and each prompt put in the tree is locked until its host copy is
# acknowledged (the CPU copies land CARRY_E2E_COPY_DELAY_S late), so upstream's decode retraction
# gained a few tokens per request and aborted the last one with a 500 ("Out of memory even after
# retracting all other requests"), a request the roomy control serves; series entry 0014 waits for
# the copies first. The control has HiCache too. In the nightly only (`--runs all`): its natural
# miss depends on when the copies land (one run of six here saw none, which fails the run as "no
# natural miss this time"), and its three runs take about 4 minutes on 2 cores.
NATURAL_HICACHE_FLAGS = (
    "--enable-hierarchical-cache",
    "--hicache-write-policy",
    "write_through",
    "--hicache-ratio",
    "4",
)
NATURAL_HICACHE = Scenario(
    "natural-hicache",
    (*natural_flags(NATURAL_POOL_TOKENS), *NATURAL_HICACHE_FLAGS),
    (*natural_flags(NATURAL_ROOMY_POOL_TOKENS), *NATURAL_HICACHE_FLAGS),
    plan_natural_traffic,
    NATURAL_SHORT_REQUESTS + 1,
    False,
    False,
    first_line="0.5.21",
)
# NATURAL's flags and a parked chunk: the long prompt's chunks go on past the short request's
# reservation until one misses and is put back (parked, holding its computed chunks locked); the
# short request then decodes alone into what is left and fills the pool. Upstream's retraction has
# nothing else to retract and aborts it with a 500 ("Out of memory even after retracting all other
# requests"), a request the roomy control serves; series entry 0015 releases the parked chunk
# instead. Pristine dies at the miss, as in NATURAL.
NATURAL_PARKED = Scenario(
    "natural-parked",
    natural_flags(NATURAL_POOL_TOKENS),
    natural_flags(NATURAL_ROOMY_POOL_TOKENS),
    plan_parked_traffic,
    2,
    False,
    False,
    first_line="0.5.21",
    parks_a_chunk=True,
)
# The hybrid LFM2 under HICACHE's pool and cache, its Mamba state (the conv state) backed up to
# host and loaded back (no_buffer: the only Mamba strategy on CPU; extra_buffer is refused there).
# no_buffer refuses the overlap scheduler (arg_groups/mamba_hook.py:158).
LFM2_FLAGS = (
    *HICACHE_FLAGS,
    "--mamba-radix-cache-strategy",
    "no_buffer",
    "--max-mamba-cache-size",
    "16",
    "--disable-overlap-schedule",
)
LFM2 = Scenario(
    "lfm2",
    LFM2_FLAGS,
    LFM2_FLAGS,
    plan_growing_traffic,
    CONCURRENCY,
    True,
    True,
    model="lfm2",
    mamba_state=True,
    first_line="0.5.20",
    recompute_flags=("--disable-radix-cache", *SMALL_POOL_FLAGS, "--max-mamba-cache-size", "16"),
)
# The gated-delta-net hybrid (Qwen3.5's text model) under LFM2's flags and traffic: its Mamba state
# is the conv state and the delta rule's float32 matrix, both backed up to host and loaded back.
# Its eight runs take about as long as LFM2's (25-80 s each, about 6 minutes on 2 cores).
GDN = Scenario(
    "gdn",
    LFM2_FLAGS,
    LFM2_FLAGS,
    plan_growing_traffic,
    CONCURRENCY,
    True,
    True,
    model="gdn",
    mamba_state=True,
    gdn_kernels=True,
    first_line="0.5.20",
    recompute_flags=LFM2.recompute_flags,
)
# A hybrid model's natural death (series entry 0017): HiCache write-through with chunked prefill
# and sglang's own Mamba pool sizing, nothing injected. Each chunk's stash and each prefill's end
# checkpoints the request's Mamba state into the tree (a slot of its own, no_buffer), and each
# such node stays locked until its host copy is acknowledged at a later step's start; with the
# CPU stand-in's copies (0.05 s each, one after the other) every slot no running request holds is
# soon on such a node and the next checkpoint finds none evictable: upstream asserts "Can not
# alloc mamba cache" (mem_cache/unified_cache/components/mamba.py:552 in 0.5.23), which kills the
# scheduler. The KV pool is roomy, so the only miss is the Mamba slot's. The control is the same
# server with a Mamba pool large enough never to run out.
CHECKPOINT_FLAGS = (
    *natural_flags(NATURAL_ROOMY_POOL_TOKENS),
    *NATURAL_HICACHE_FLAGS,
    "--mamba-radix-cache-strategy",
    "no_buffer",
    "--disable-overlap-schedule",
    "--max-mamba-cache-size",
)
LFM2_CHECKPOINT = Scenario(
    "lfm2-checkpoint",
    (*CHECKPOINT_FLAGS, "16"),
    (*CHECKPOINT_FLAGS, "256"),
    plan_natural_traffic,
    NATURAL_SHORT_REQUESTS + 1,
    False,
    False,
    model="lfm2",
    mamba_state=True,
    mamba_checkpoints=True,
    first_line=NATURAL.first_line,
)
# The same on the gated-delta-net hybrid.
GDN_CHECKPOINT = dataclasses.replace(LFM2_CHECKPOINT, name="gdn-checkpoint", model="gdn", gdn_kernels=True)
# NATURAL (upstream's KV prefill miss) on the hybrid families: no HiCache, a Mamba pool large
# enough for the traffic, so the only miss is the KV pool's; the series unwinds it as on the dense
# model.
HYBRID_NATURAL_FLAGS = (
    "--mamba-radix-cache-strategy",
    "no_buffer",
    "--disable-overlap-schedule",
    "--max-mamba-cache-size",
    "256",
)
LFM2_NATURAL = dataclasses.replace(
    NATURAL,
    name="lfm2-natural",
    flags=(*NATURAL.flags, *HYBRID_NATURAL_FLAGS),
    control_flags=(*NATURAL.control_flags, *HYBRID_NATURAL_FLAGS),
    model="lfm2",
    mamba_state=True,
)
GDN_NATURAL = dataclasses.replace(LFM2_NATURAL, name="gdn-natural", model="gdn", gdn_kernels=True)
