"""The run plan: which servers run, in which order, and what each serves. CPU_PLAN is the CPU
line's table, one row per run (its RunSpec and the tree it serves); a run's kind (verdicts.py)
says what it must show and its scenario (scenarios.py) what it is given and sent. On a GPU each
model of --models runs control, pristine and patched. plan_cpu and plan_gpu turn the command
line into the servers to start, model by model (ModelPlan), or a PlanError (exit 2)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cpu_line  # in ci/e2e (it puts the tool's package on sys.path)
from cpu_line import unpack_wheel
from packaging.version import Version

from sglang_carry.errors import CarryError

from .models import MODELS
from .scenarios import (
    GDN,
    GDN_CHECKPOINT,
    GDN_NATURAL,
    HICACHE,
    LFM2,
    LFM2_CHECKPOINT,
    LFM2_NATURAL,
    MAX_TOTAL_TOKENS,
    NATURAL,
    NATURAL_HICACHE,
    NATURAL_PARKED,
    Scenario,
)
from .server import CPU_FLAGS, CPU_STANDINS, ROOT, cpu_env
from .verdicts import COMPARING, CONTROL, PATCHED, PRISTINE, RECOMPUTE, WITHOUT_LOAD_WAIT

# tp2-uneven: what rank 0's allocator withholds (reports fewer free tokens than it has), a quarter
# of the pool. A request holds PREFIX_TOKENS + SUFFIX_TOKENS + MAX_NEW_TOKENS = 280 tokens and
# CONCURRENCY (4) arrive together; 4 x 280 exceed the pool, so a full pool admits 3 at most
# (840 <= 1024) where rank 0 sees 768 free and admits 2 (560; 840 > 768): admission differs from
# the first wave on, and whenever 2 run rank 0 sees 208 free (less than one request) where rank 1
# sees 464. 768 still holds one request, so one rank alone could always make progress.
WITHHELD_TOKENS = MAX_TOTAL_TOKENS // 4
# tp2-drift and tp2-delayer: an eighth of the pool, drifting between none and all of it. The
# agreement takes the least reading, so a quarter would leave the ledger at 768 almost always;
# there, before series entry 0014, upstream's decode retraction sometimes gained nothing
# (write-through backups still locked the retracted requests' nodes) and aborted its last request
# with a 500 (upstream's mechanism, not a rank disagreement; tp2-uneven, at a quarter, now shows
# that 0014 ends it). An eighth keeps these runs about the readings' drift.
DRIFT_WITHHELD_TOKENS = MAX_TOTAL_TOKENS // 8
# tp2-l3: HiCache's L3 tier (the file backend), its prefetches stopped by the `timeout` policy,
# whose termination check is an all-reduce inside admission (unified_radix_cache.py:2295-2312 in
# 0.5.23, `_can_terminate_prefetch`). The host pool (1.25 x the device pool, 1280 tokens) holds
# fewer than five of a wave's eight 256-token prefixes, so every later wave finds at least three
# of them only in the files and prefetches them while the ranks' readings drift. (With twice the
# device pool, 2048 tokens, the host held all eight prefixes in runs on a busy machine, and
# nothing was read from the files.)
L3_FLAGS = (
    "--hicache-storage-backend",
    "file",
    "--hicache-storage-prefetch-policy",
    "timeout",
    "--hicache-ratio",
    "1.25",
    # Prefetch whatever the host misses (the default threshold, 256 tokens, skips a prompt whose
    # prefix is still partly on host), and give a prefetch 30 s rather than 1 s: the file backend
    # reads a file per token (page size 1), and on a busy 2-core machine every prefetch outran
    # the default budget, so its `timeout` cut it before anything was read.
    "--hicache-storage-backend-extra-config",
    '{"prefetch_threshold": 16, "prefetch_timeout_base": 30}',
)


# natural-hicache: each HiCache copy lands this late (the CPU stand-in's delay; 0.05 s elsewhere),
# so the prompts' write-through copies are still in flight when the pool fills.
SLOW_COPIES = (("CARRY_E2E_COPY_DELAY_S", "0.3"),)


@dataclass(frozen=True)
class RunSpec:
    """One server run: what it serves (`site` first on PYTHONPATH, else the interpreter's own
    sglang) and how it is broken (the kind)."""

    name: str  # e.g. "patched", "tp2-control"
    kind: str  # control | pristine | patched | without-load-wait | recompute (verdicts.py)
    site: Path | None = None
    tp: int = 1
    # Where misses are injected (None: every rank) and whether the pool is marked rank-local.
    miss_ranks: tuple[int, ...] | None = None
    rank_local: bool = False
    # Environment this run's server needs beyond the others'.
    extra_env: tuple[tuple[str, str], ...] = ()
    # Ranks of different free space: the allocator reports this many tokens fewer than it has, on
    # withhold_ranks (None: every rank), while the scheduler is busy (hook/sitecustomize.py).
    withheld_tokens: int = 0
    withhold_ranks: tuple[int, ...] | None = None
    # The withheld amount changes at every reading (as kvcached's physical reading does).
    withheld_drift: bool = False
    # Server flags this run adds (the prefill delayer).
    server_flags: tuple[str, ...] = ()
    # Where the misses are injected: a prefill batch's allocation, or a decode step's.
    miss_at: str = "prefill"
    scenario: Scenario = HICACHE
    # HiCache's L3 tier: the file backend in a folder of the run's own (L3_FLAGS).
    l3_storage: bool = False
    # The negative control of upstream's rank-consensus checker (on in every two-rank run): it must
    # stop this run's server ("Found rank divergence").
    checker_must_fire: bool = False

    @property
    def control_name(self) -> str:
        ranks = "" if self.tp == 1 else f"tp{self.tp}-"
        scenario = "" if self.scenario is HICACHE else f"{self.scenario.name}-"
        return f"{ranks}{scenario}{CONTROL}"

    def server_flags_of_scenario(self) -> tuple[str, ...]:
        if self.kind == RECOMPUTE:
            assert self.scenario.recompute_flags is not None, f"{self.scenario.name} has no recompute run"
            return self.scenario.recompute_flags
        return self.scenario.control_flags if self.kind == CONTROL else self.scenario.flags


def two_ranks(name: str, kind: str, **more: Any) -> RunSpec:
    """A --tp-size 2 run on CPU: the pool rank-local on both ranks (as a kvcached pool is), each
    rank's OpenMP core named, which sglang's CPU engine requires with more than one rank, and
    upstream's rank-consensus checker on (it stops the server where the ranks' recorded decisions
    differ)."""
    env = (("SGLANG_CPU_OMP_THREADS_BIND", "0|1"), ("SGLANG_ENABLE_RANK_CONSENSUS_CHECKER", "1"))
    return RunSpec(name, kind, tp=2, rank_local=True, extra_env=env, **more)


def uneven_ranks(name: str, withheld_tokens: int, **more: Any) -> RunSpec:
    """A patched two-rank run whose ranks' free space differs: rank 0 reports `withheld_tokens`
    fewer free tokens than it has (a co-tenant of an elastic pool), and rank 1 misses."""
    return two_ranks(
        name, PATCHED, miss_ranks=(1,), withheld_tokens=withheld_tokens, withhold_ranks=(0,), **more
    )


def hybrid_natural_runs(scenario: Scenario) -> tuple[tuple[RunSpec, str], ...]:
    """A natural scenario's control, pristine and patched runs, on one rank and on two."""
    name = scenario.name
    kinds = ((CONTROL, PATCHED), (PRISTINE, PRISTINE), (PATCHED, PATCHED))
    one = tuple((RunSpec(f"{name}-{kind}", kind, scenario=scenario), serves) for kind, serves in kinds)
    two = tuple((two_ranks(f"tp2-{name}-{kind}", kind, scenario=scenario), serves) for kind, serves in kinds)
    return one + two


# The CPU runs, in the order they run (each control before the runs compared with it), each with
# what it serves: "pristine" and "patched" (the wheels), or the tree without the load wait.
CPU_PLAN: tuple[tuple[RunSpec, str], ...] = (
    (RunSpec(CONTROL, CONTROL), PATCHED),
    (RunSpec(PRISTINE, PRISTINE), PRISTINE),
    (RunSpec(PATCHED, PATCHED), PATCHED),
    (RunSpec(WITHOUT_LOAD_WAIT, WITHOUT_LOAD_WAIT), WITHOUT_LOAD_WAIT),
    (two_ranks("tp2-control", CONTROL), PATCHED),
    (two_ranks("tp2-pristine", PRISTINE, miss_ranks=(1,)), PRISTINE),
    (two_ranks("tp2-patched", PATCHED, miss_ranks=(1,)), PATCHED),
    # The official wheel on two ranks whose free space differs (rank 0 withholds, drifting), nothing
    # injected: its ranks evict and admit apart, and upstream's own checker must stop it.
    (
        two_ranks(
            "tp2-uneven-pristine",
            PRISTINE,
            miss_ranks=(),
            withheld_tokens=DRIFT_WITHHELD_TOKENS,
            withhold_ranks=(0,),
            withheld_drift=True,
            checker_must_fire=True,
        ),
        PRISTINE,
    ),
    # As tp2-patched, and rank 0 reports WITHHELD_TOKENS fewer free tokens than it has (a
    # co-tenant of an elastic pool): the ranks' free space differs, so they can admit and evict
    # differently. Kind patched: every request finishes, outputs equal tp2-control's.
    (uneven_ranks("tp2-uneven", WITHHELD_TOKENS), PATCHED),
    # As tp2-uneven, with rank 0's reading changing at every read (none, a third, two thirds, all
    # of DRIFT_WITHHELD_TOKENS, in turn), as kvcached's TTL-cached physical reading makes it drift: the
    # ranks agree on a ledger, so they still admit, evict and retract alike.
    (uneven_ranks("tp2-drift", DRIFT_WITHHELD_TOKENS, withheld_drift=True), PATCHED),
    # As tp2-drift's withholding (steady), with the prefill delayer, which negotiates over the TP
    # group inside admission from the pools' usage.
    (uneven_ranks("tp2-delayer", DRIFT_WITHHELD_TOKENS, server_flags=("--enable-prefill-delayer",)), PATCHED),
    # As tp2-drift, with HiCache's L3 tier: prefetches from the files in flight while the ranks'
    # readings drift (a prefetch's `timeout` check all-reduces inside admission).
    (
        uneven_ranks(
            "tp2-l3", DRIFT_WITHHELD_TOKENS, withheld_drift=True, server_flags=L3_FLAGS, l3_storage=True
        ),
        PATCHED,
    ),
    # The miss in a decode step's allocation on rank 1 only (a co-tenant took the physical memory
    # the agreed ledger counts): pristine's rank 1 dies while rank 0 waits in the forward; the
    # series gives the step back and retracts the same request on both ranks.
    (two_ranks("tp2-decode-pristine", PRISTINE, miss_ranks=(1,), miss_at="decode"), PRISTINE),
    (two_ranks("tp2-decode-patched", PATCHED, miss_ranks=(1,), miss_at="decode"), PATCHED),
    # Upstream's own prefill allocation miss (NATURAL: no hook, the traffic and flags bring it
    # about): pristine dies of it; the series puts the batch back and serves everything, its
    # outputs equal to the same traffic's on a pool that never misses (natural-control).
    (RunSpec("natural-control", CONTROL, scenario=NATURAL), PATCHED),
    (RunSpec("natural-pristine", PRISTINE, scenario=NATURAL), PRISTINE),
    (RunSpec("natural-patched", PATCHED, scenario=NATURAL), PATCHED),
    (two_ranks("tp2-natural-control", CONTROL, scenario=NATURAL), PATCHED),
    (two_ranks("tp2-natural-pristine", PRISTINE, scenario=NATURAL), PRISTINE),
    (two_ranks("tp2-natural-patched", PATCHED, scenario=NATURAL), PATCHED),
    # The same with HiCache on (NATURAL_HICACHE): while the unwound chunk is parked, the short
    # requests decode in a full pool whose prompts are locked by their host copies; every request
    # must finish (no 500 from the decode retraction), outputs equal to the roomy control's.
    (RunSpec("natural-hicache-control", CONTROL, scenario=NATURAL_HICACHE, extra_env=SLOW_COPIES), PATCHED),
    (
        RunSpec("natural-hicache-pristine", PRISTINE, scenario=NATURAL_HICACHE, extra_env=SLOW_COPIES),
        PRISTINE,
    ),
    (RunSpec("natural-hicache-patched", PATCHED, scenario=NATURAL_HICACHE, extra_env=SLOW_COPIES), PATCHED),
    # A chunk parked while one short request decodes into a full pool (NATURAL_PARKED): the
    # series releases the chunk rather than abort the request; both finish, outputs equal. Two
    # ranks with a rank-local pool: both release alike (the decision reads the agreed ledger).
    (RunSpec("natural-parked-control", CONTROL, scenario=NATURAL_PARKED), PATCHED),
    (RunSpec("natural-parked-pristine", PRISTINE, scenario=NATURAL_PARKED), PRISTINE),
    (RunSpec("natural-parked-patched", PATCHED, scenario=NATURAL_PARKED), PATCHED),
    (two_ranks("tp2-natural-parked-control", CONTROL, scenario=NATURAL_PARKED), PATCHED),
    (two_ranks("tp2-natural-parked-pristine", PRISTINE, scenario=NATURAL_PARKED), PRISTINE),
    (two_ranks("tp2-natural-parked-patched", PATCHED, scenario=NATURAL_PARKED), PATCHED),
    # The hybrid LFM2 (LFM2: its conv state backed up to host and loaded back): the control's
    # outputs equal a run that recomputes every prompt; the miss is injected as for the dense
    # model; the series without its load wait shows the seed's hazard, counted by the copies that
    # landed in a Mamba slot after its release.
    (RunSpec("lfm2-control", CONTROL, scenario=LFM2), PATCHED),
    (RunSpec("lfm2-recompute", RECOMPUTE, scenario=LFM2), PATCHED),
    (RunSpec("lfm2-pristine", PRISTINE, scenario=LFM2), PRISTINE),
    (RunSpec("lfm2-patched", PATCHED, scenario=LFM2), PATCHED),
    (RunSpec("lfm2-without-load-wait", WITHOUT_LOAD_WAIT, scenario=LFM2), WITHOUT_LOAD_WAIT),
    (two_ranks("tp2-lfm2-control", CONTROL, scenario=LFM2), PATCHED),
    (two_ranks("tp2-lfm2-pristine", PRISTINE, miss_ranks=(1,), scenario=LFM2), PRISTINE),
    (two_ranks("tp2-lfm2-patched", PATCHED, miss_ranks=(1,), scenario=LFM2), PATCHED),
    # A hybrid model's natural death (LFM2_CHECKPOINT, GDN_CHECKPOINT: nothing injected, HiCache
    # write-through, sglang's own Mamba pool sizing): pristine dies of the Mamba checkpoint's
    # assertion; the series waits for the copies in flight or skips the checkpoint (0017), every
    # request finishes, outputs equal the roomy control's. And upstream's KV prefill miss on the
    # hybrid families (LFM2_NATURAL, GDN_NATURAL), unwound as on the dense model.
    *hybrid_natural_runs(LFM2_CHECKPOINT),
    *hybrid_natural_runs(LFM2_NATURAL),
    # The gated-delta-net hybrid (GDN: Qwen3.5's text model; its Mamba state has a non-empty
    # temporal part, the delta rule's matrix), as LFM2's runs.
    (RunSpec("gdn-control", CONTROL, scenario=GDN), PATCHED),
    (RunSpec("gdn-recompute", RECOMPUTE, scenario=GDN), PATCHED),
    (RunSpec("gdn-pristine", PRISTINE, scenario=GDN), PRISTINE),
    (RunSpec("gdn-patched", PATCHED, scenario=GDN), PATCHED),
    (RunSpec("gdn-without-load-wait", WITHOUT_LOAD_WAIT, scenario=GDN), WITHOUT_LOAD_WAIT),
    (two_ranks("tp2-gdn-control", CONTROL, scenario=GDN), PATCHED),
    (two_ranks("tp2-gdn-pristine", PRISTINE, miss_ranks=(1,), scenario=GDN), PRISTINE),
    (two_ranks("tp2-gdn-patched", PATCHED, miss_ranks=(1,), scenario=GDN), PATCHED),
    *hybrid_natural_runs(GDN_CHECKPOINT),
    *hybrid_natural_runs(GDN_NATURAL),
)
CPU_RUNS = tuple(spec.name for spec, _ in CPU_PLAN)
# What `--runs` left out runs (./scripts/test, so every CI run): each series entry's proof on a
# real server once, pristine dying and patched serving with outputs equal to its control's, on
# two ranks where the entry is about the ranks agreeing, and the negative control of upstream's
# rank-consensus checker. A run costs a server's start-up, about 45 s of imports on 2 cores,
# whatever it serves: these 20 take about 21 minutes there, and all 68 more than CI's 90 (it timed
# out at the 43rd). The nightly runs every run (`--runs all`).
CPU_DEFAULT_RUNS = (
    # HiCache with a miss injected while the batch's load is in flight: the prefill unwind, its
    # load wait, the ranks' agreement under drifting readings, and a decode step's miss.
    *(CONTROL, PRISTINE, PATCHED, WITHOUT_LOAD_WAIT),
    # tp2-uneven-pristine: upstream's rank-consensus checker, on in every two-rank run, must stop
    # the official wheel whose ranks' free space differs.
    *("tp2-control", "tp2-pristine", "tp2-patched", "tp2-uneven-pristine", "tp2-drift"),
    *("tp2-decode-pristine", "tp2-decode-patched"),
    # Upstream's own prefill miss, with a chunk parked behind a decoding request, on two ranks (one
    # rank's runs, the same entry without the ranks' votes, are the nightly's).
    *(f"tp2-natural-parked-{kind}" for kind in (CONTROL, PRISTINE, PATCHED)),
    # A hybrid model's Mamba state loaded back (the load wait with Mamba slots), and its Mamba
    # checkpoint's natural death, the latter on two ranks.
    *(f"lfm2-{kind}" for kind in (CONTROL, PRISTINE, PATCHED)),
    *(f"tp2-lfm2-checkpoint-{kind}" for kind in (CONTROL, PRISTINE, PATCHED)),
)
# `--runs all`: every run the line has (the nightly).
ALL_RUNS = "all"
CPU_MODEL_OF = {spec.name: spec.scenario.model for spec, _ in CPU_PLAN}
CPU_MODELS = tuple(dict.fromkeys(CPU_MODEL_OF.values()))


def chosen_runs(runs: str | None, models: str | None) -> list[str]:
    """The runs `--runs` names (`all`: every run); without it the default run's, and every run of
    a model `--models` names (its runs are what was asked for, in the default run or not)."""
    if runs == ALL_RUNS:
        return list(CPU_RUNS)
    if runs is not None:
        return [name for name in runs.split(",") if name]
    named = {m for m in models.split(",") if m} if models is not None else set()
    return [name for name in CPU_RUNS if name in CPU_DEFAULT_RUNS or CPU_MODEL_OF[name] in named]


def runs_not_on_line(names: Sequence[str], version: str) -> dict[str, str]:
    """The runs among `names` whose scenario the line's code lacks, each with the reason."""
    return {
        spec.name: f"needs sglang {spec.scenario.first_line} or newer ({spec.scenario.name})"
        for spec, _ in CPU_PLAN
        if spec.name in names and Version(version) < Version(spec.scenario.first_line)
    }


def runs_without_their_control(names: Sequence[str]) -> list[str]:
    return [
        f"{spec.name} needs {spec.control_name}"
        for spec, _ in CPU_PLAN
        if spec.name in names and spec.kind in COMPARING and spec.control_name not in names
    ]


def cpu_specs(line: Any, out: Path, names: Sequence[str]) -> list[RunSpec]:
    """The chosen runs of CPU_PLAN, each with the folder it serves (the wheels are unpacked)."""
    sites = {
        PRISTINE: unpack_wheel(line.pristine_wheel, out / "sites" / "pristine", line.python),
        PATCHED: unpack_wheel(line.patched_wheel, out / "sites" / "patched", line.python),
        WITHOUT_LOAD_WAIT: line.without_load_wait,
    }
    return [dataclasses.replace(spec, site=sites[serves]) for spec, serves in CPU_PLAN if spec.name in names]


def official_wheel_of(patched: Path) -> Path:
    """The upstream wheel a patched wheel was built from, in upstream/.downloads (its provenance)."""
    with zipfile.ZipFile(patched) as archive:
        name = next(n for n in archive.namelist() if n.endswith("sglang_carry_provenance.json"))
        upstream: str = json.loads(archive.read(name))["upstream"]["file"]
    return ROOT / "upstream" / ".downloads" / upstream


@dataclass(frozen=True)
class ModelPlan:
    """One model's runs, in the order they run, and what starts their servers: the flags before
    each run's own, what goes on PYTHONPATH after the run's tree, and the interpreter."""

    model: str
    flags: Sequence[str]
    specs: list[RunSpec]
    pythonpath: list[Path]
    python: str


@dataclass(frozen=True)
class Prepared:
    """What main runs: the plans, the servers' environment, and what report.json says of the line."""

    plans: list[ModelPlan]
    env: dict[str, str]
    report: dict[str, Any]


class PlanError(Exception):
    """The runs asked for cannot run (the message says why): exit 2, no server started."""


def plan_cpu(
    runs: str | None, models: str | None, upstream: str | None, out: Path, env: dict[str, str]
) -> Prepared:
    """`--runs` of CPU_PLAN for `--models`, on the line `upstream` as cpu_line.py prepares it.
    Without `--runs`: the default run's (CPU_DEFAULT_RUNS) and every run of a model `--models`
    names; `--runs all`: every run. Either way only those the line has."""
    chosen_models = [m for m in (models or ",".join(CPU_MODELS)).split(",") if m]
    names = chosen_runs(runs, models)
    unknown = sorted(set(names) - set(CPU_RUNS))
    unknown_models = sorted(set(chosen_models) - set(CPU_MODELS))
    if unknown or unknown_models:
        what = f"unknown run(s) {', '.join(unknown)}" if unknown else f"--models {models}"
        raise PlanError(
            f"{what}: on CPU the runs are {', '.join(CPU_RUNS)}, the models {', '.join(CPU_MODELS)}"
        )
    names = [name for name in names if CPU_MODEL_OF[name] in chosen_models]
    missing = runs_without_their_control(names)
    if missing:
        raise PlanError(f"--runs: {'; '.join(missing)} (its outputs are compared with it)")
    try:
        line = cpu_line.prepare(upstream, out)
        absent = runs_not_on_line(names, line.version)
        if absent and runs not in (None, ALL_RUNS):
            what = "; ".join(f"{name} {why}" for name, why in absent.items())
            raise PlanError(f"--runs: {what} (the line is {line.version}): leave it out")
        specs = cpu_specs(line, out, [name for name in names if name not in absent])
    except (CarryError, subprocess.CalledProcessError, OSError, zipfile.BadZipFile) as error:
        raise PlanError(f"the line cannot be prepared: {error}") from error
    plans = [
        ModelPlan(
            model,
            CPU_FLAGS,
            [spec for spec in specs if spec.scenario.model == model],
            [CPU_STANDINS, line.server_deps],
            str(line.python),
        )
        for model in dict.fromkeys(spec.scenario.model for spec in specs)
    ]
    report = {
        "runs_not_on_this_line": absent,
        "upstream": line.version,
        "wheel": line.patched_wheel.name,
        "pristine_wheel": line.pristine_wheel.name,
        "without_load_wait": f"the series without {line.load_wait_entry}",
    }
    return Prepared(plans, cpu_env(env, out), report)


def plan_gpu(
    wheel: Path | None,
    pristine_wheel: Path | None,
    models: str | None,
    python: str,
    out: Path,
    env: dict[str, str],
) -> Prepared:
    """Control, pristine and patched for each of `--models` (default: dense, hybrid): the patched
    wheel is the interpreter's own, the pristine one unpacked first on its PYTHONPATH."""
    if wheel is None:
        raise PlanError("--wheel is required on a GPU (the patched wheel in this venv)")
    pristine_wheel = pristine_wheel or official_wheel_of(wheel)
    pristine_site = unpack_wheel(pristine_wheel, out / "pristine-site", python)
    plans = [
        ModelPlan(
            name,
            MODELS[name].gpu_flags,
            [
                RunSpec(CONTROL, CONTROL),
                RunSpec(PRISTINE, PRISTINE, pristine_site),
                RunSpec(PATCHED, PATCHED),
            ],
            [],
            python,
        )
        for name in [n for n in (models or "dense,hybrid").split(",") if n]
    ]
    return Prepared(plans, env, {"wheel": wheel.name, "pristine_wheel": pristine_wheel.name})
