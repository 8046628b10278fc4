"""Running the plan: one server per run, started with what its RunSpec asks of the hook, sent its
scenario's traffic within bounds (no run can hang the harness), its evidence gathered and
judged; each control's outputs kept for the runs compared with it."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import metrics
from .plan import ModelPlan, RunSpec
from .server import HOOK, PeakMemory, Server, free_port, server_command
from .traffic import REQUEST_TIMEOUT_S, Outcome, drive, timed_out
from .verdicts import CONTROL, INJECTING, PATCHED, RANK_DIVERGENCE, Run, judge, read_counters, take_counters

# A run's traffic at most; the misses the hook injects per rank; a server's start-up at most.
RUN_TIMEOUT_S = 600
MISS_LIMIT = 3
STARTUP_TIMEOUT_S = 900
# What the patched scheduler logs when it has put prefills back (run.unwinds_logged counts it).
UNWIND_LOG = re.compile(r"Prefill allocation (missed|diverged across ranks); unwound")


# Servers started for one run when each finds its HTTP port taken (a race, not the run's outcome).
PORT_ATTEMPTS = 3
# Servers started for one run when each shows nothing of what it is for, for a reason of timing: a
# natural run whose traffic did not bring about the server's own miss (a copy landing before or
# after a checkpoint), or the checker's negative control whose server died of a miss before the
# checker's thread compared the ranks. Each attempt that showed nothing is printed; the last one's
# verdict stands.
NATURAL_ATTEMPTS = 3


def run_once(
    model: str,
    spec: RunSpec,
    command: Sequence[str],
    out: Path,
    base_env: dict[str, str],
    pythonpath: Sequence[Path],
    control: dict[str, list[int]] | None,
    port: int,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    run_timeout_s: float = RUN_TIMEOUT_S,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[Run, list[Outcome]]:
    started_at = time.monotonic()
    log = f"{model}-{spec.name}.log"
    scenario = spec.scenario
    run = Run(
        model,
        spec.name,
        spec.kind,
        spec.tp,
        spec.withheld_tokens,
        spec.miss_at,
        spec.withheld_drift,
        scenario.name,
        l3_storage=spec.l3_storage,
        rank_local=spec.rank_local,
        mamba_checkpoints=scenario.mamba_checkpoints,
        checker_must_fire=spec.checker_must_fire,
        log=log,
    )
    counters = out / "counters" / f"{model}-{spec.name}"
    shutil.rmtree(counters, ignore_errors=True)
    env = dict(base_env)
    path = [*map(str, [*([spec.site] if spec.site else []), *pythonpath, HOOK]), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path).rstrip(os.pathsep)
    env["CARRY_E2E_COUNTERS_DIR"] = str(counters)
    # The hook runs in every run (it counts loads and unwinds and records a scheduler's death); a
    # control or recompute run, and a run whose misses are the server's own (natural), inject nothing.
    env["CARRY_E2E_INJECT"] = "1"
    env["CARRY_E2E_MISS_LIMIT"] = str(MISS_LIMIT) if scenario.injects and spec.kind in INJECTING else "0"
    if spec.miss_ranks is not None:
        env["CARRY_E2E_MISS_RANKS"] = ",".join(map(str, spec.miss_ranks))
    if spec.rank_local:
        env["CARRY_E2E_RANK_LOCAL"] = "1"
    if scenario.mamba_state:
        env["CARRY_E2E_MAMBA"] = "1"
    if scenario.gdn_kernels:
        env["CARRY_E2E_GDN"] = "1"
    if spec.miss_at != "prefill":
        env["CARRY_E2E_MISS_AT"] = spec.miss_at
    if spec.withheld_tokens:
        env["CARRY_E2E_WITHHELD_TOKENS"] = str(spec.withheld_tokens)
        if spec.withhold_ranks is not None:
            env["CARRY_E2E_WITHHOLD_RANKS"] = ",".join(map(str, spec.withhold_ranks))
        if spec.withheld_drift:
            env["CARRY_E2E_WITHHELD_DRIFT"] = "1"
    if spec.l3_storage:
        storage = out / "l3-storage" / f"{model}-{spec.name}"
        shutil.rmtree(storage, ignore_errors=True)
        storage.mkdir(parents=True)
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(storage)
        env["CARRY_E2E_L3"] = "1"
    env.update(spec.extra_env)
    server = Server.start(command, env, out / run.log, port)
    memory = PeakMemory(server.process.pid)
    outcomes: list[Outcome] = []
    try:
        run.started = server.wait_healthy(startup_timeout_s)
        run.port_taken = not run.started and server.port_taken()
        if run.started:
            deadline = time.monotonic() + run_timeout_s
            outcomes = drive(
                server.base_url,
                scenario.plan(),
                server.alive,
                deadline,
                request_timeout_s,
                scenario.concurrency,
            )
            # Requests that timed out while the server was still up: it hung (it may die later).
            run.hung = server.alive() and any(timed_out(o) for o in outcomes)
            time.sleep(1.0)  # let a dying scheduler take the server down before we look
            if spec.kind == PATCHED and server.alive():
                run.scraped = metrics.scrape(server.base_url)
        run.server_died = not server.alive()
    finally:
        run.peak_rss_mb = memory.stop()
        server.stop()
    text = (out / run.log).read_text(errors="replace")
    take_counters(run, read_counters(counters))
    run.unwinds_logged = len(UNWIND_LOG.findall(text))
    run.rank_divergence_found = RANK_DIVERGENCE in text
    if not run.started:
        outcomes = [
            Outcome(r.key, False, error="server never became healthy") for w in scenario.plan() for r in w
        ]
    judge(run, outcomes, control, scenario)
    run.seconds = time.monotonic() - started_at
    return run, outcomes


def run_plans(
    plans: Sequence[ModelPlan],
    model_dirs: Mapping[str, Path],
    out: Path,
    env: dict[str, str],
    run_timeout_s: float = RUN_TIMEOUT_S,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
) -> list[Run]:
    """Every run of every plan, in order, each compared with its control run's outputs."""
    runs: list[Run] = []
    for plan in plans:
        controls: dict[str, dict[str, list[int]]] = {}
        for spec in plan.specs:
            flags = [
                *plan.flags,
                *(["--tp-size", str(spec.tp)] if spec.tp > 1 else []),
                # A patched server exports the series' counters; the run reads them from /metrics.
                *([metrics.METRICS_FLAG] if spec.kind == PATCHED else []),
                *spec.server_flags,
            ]
            control = controls.get(spec.control_name) if spec.kind != CONTROL else None
            port_attempts = natural_attempts = 0
            while True:
                port = free_port()
                command = server_command(
                    plan.python, model_dirs[plan.model], port, flags, spec.server_flags_of_scenario()
                )
                run, outcomes = run_once(
                    plan.model,
                    spec,
                    command,
                    out,
                    env,
                    plan.pythonpath,
                    control,
                    port,
                    run_timeout_s=run_timeout_s,
                    request_timeout_s=request_timeout_s,
                )
                port_attempts += run.port_taken
                natural_attempts += run.showed_nothing
                if run.port_taken and port_attempts < PORT_ATTEMPTS:
                    print(
                        f"e2e: {plan.model} {spec.name}: port {port} was taken before the server bound it;"
                        " again"
                    )
                elif run.showed_nothing and natural_attempts < NATURAL_ATTEMPTS:
                    print(
                        f"e2e: {plan.model} {spec.name}: {run.verdict} ({run.seconds:.0f} s);"
                        f" again ({natural_attempts + 1} of {NATURAL_ATTEMPTS})",
                        flush=True,
                    )
                else:
                    break
            if natural_attempts and not run.showed_nothing:
                run.verdict += f" (on attempt {natural_attempts + 1}: the earlier showed nothing)"
            if spec.kind == CONTROL:
                controls[spec.name] = {o.key: o.output_ids for o in outcomes if o.ok}
            runs.append(run)
            print(f"e2e: {plan.model} {spec.name}: {run.verdict} ({run.seconds:.0f} s)", flush=True)
    return runs
