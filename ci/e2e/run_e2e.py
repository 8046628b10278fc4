"""End-to-end: a real sglang server, HiCache on, a KV miss injected while the batch's load is in
flight; on one GPU (default) or on CPU, one rank and two.

    python ci/e2e/run_e2e.py --wheel dist/sglang-<V>+carry.<N>-*.whl --out build/e2e
        [--pristine-wheel upstream/.downloads/sglang-<V>-*.whl] [--models dense,hybrid]
    python ci/e2e/run_e2e.py --device cpu [--upstream V] --out build/e2e-cpu [--runs ...]

GPU (run with the line's GPU environment, ci/gpu-env: the official wheel's requirements with the
patched wheel installed): for each tiny model written here (no download: a dense Llama with
seeded random weights in safetensors, and a hybrid Qwen3.5 (Gated DeltaNet + attention) served
with --load-format dummy), the runs control, pristine and patched.

CPU (`--device cpu`, the dense model only: the hybrid one needs CPU kernels nobody ships): the
line `--upstream V` (default: the newest line with a series) as cpu_line.py prepares it (the
pristine wheel from the pin, the patched wheel built if missing, the series without its load
wait), served by the line's test environment with SGLANG_USE_CPU_ENGINE=1 and the stand-ins of
ci/e2e/cpu/ (sgl_kernel's CPU ops, the two HiCache copy kernels, plain host-pool memory, and
HiCache's copy streams running their copies later on a worker, so a load is really in flight).
The runs (`--runs`, default the default run's, CPU_DEFAULT_RUNS, that the line has; `--runs all`:
every run of CPU_RUNS the line has, as the nightly runs it): control, pristine, patched,
without-load-wait, and the same first three with --tp-size 2 (tp2-control, tp2-pristine,
tp2-patched), the miss on rank 1 only and the KV pool marked rank-local on every rank, as a
kvcached elastic pool is; and tp2-uneven, tp2-patched with rank 0's free space reported
WITHHELD_TOKENS lower while its scheduler is busy, so the ranks admit differently; tp2-drift,
as tp2-uneven with the withheld amount changing at every reading (as kvcached's TTL-cached
physical reading drifts); tp2-delayer, as tp2-uneven with --enable-prefill-delayer, which
negotiates over the TP group inside admission.
And the natural runs, no miss injected: natural-control, natural-pristine, natural-patched and
their tp2- twins serve traffic under which upstream's own admission overcommits a chunked prefill
(NATURAL: the flags, traffic and mechanism), natural-control on a pool large enough not to miss;
a line older than a scenario's first_line runs without them (report.json names them).
The hybrid runs (`lfm2-*`, `tp2-lfm2-*`; nightly and `--models` only: `gdn-*`, `tp2-gdn-*`) serve
tiny hybrid models with their Mamba state backed up to host and loaded back (README: the hybrid runs).

Every server runs `python -m sglang.launch_server` with --skip-tokenizer-init and no CUDA graphs;
the injected runs (HICACHE) with native HiCache (write-through) and a 1024-token KV pool, under
bounded traffic that fills the device pool, evicts to host and loads back. Expected:
- control: no miss; every request finishes, host hits are seen;
- pristine: misses injected; a scheduler dies of the allocation error (its own exception, recorded
  by the hook in the scheduler process: raised in sglang's mem_cache). A pristine server that
  survives means upstream fixed the bug: reported (drop the unwind entries), not failed;
- patched: misses injected; every request finishes, every rank unwinds, the greedy outputs equal
  the control run's (tp2-patched, tp2-uneven: tp2-control's); tp2-uneven also fails when no
  reading of the free space was reduced;
- without-load-wait (CPU): misses injected; every request finishes and the hazard shows: some
  outputs differ from control's (how many is reported). Equal outputs fail: the wait went unseen.
- natural runs: the control never misses; pristine's scheduler dies of its own allocation error
  (a pristine that survives is "no natural miss this time", a failure: the run showed nothing);
  patched unwinds on every rank, every request finishes, float32 outputs equal natural-control's.
  A differing output is reported with how often its prefill was put back (by rid, from the
  scheduler's unwinds).
A run meant to inject that saw no miss fails. A run whose requests time out while its server is
alive is a hang (requests are bounded by REQUEST_TIMEOUT_S, a run by RUN_TIMEOUT_S).

The miss is injected by hook/sitecustomize.py: the KV allocator returns None inside the batch's
allocation while its HiCache load is in flight, as an elastic pool reports a miss. The server runs
in its own process group on 127.0.0.1 and is killed by its PID's group. Prints a table last;
writes report.json, report.md and every server log to --out. Exit 0 when every run met its
expectation (a surviving pristine run included), 1 otherwise, 2 when the line cannot be prepared.

The harness is the package e2e_harness beside this file (its docstring says which module holds
what, and what a new model family or kind of run takes); this file parses, plans, runs, reports.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from e2e_harness.models import write_models
from e2e_harness.plan import PlanError, plan_cpu, plan_gpu
from e2e_harness.report import publish
from e2e_harness.runner import RUN_TIMEOUT_S, run_plans
from e2e_harness.server import Terminated, interrupted_exit, servers_killed_on_interrupt
from e2e_harness.traffic import REQUEST_TIMEOUT_S


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/e2e/run_e2e.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--upstream", help="CPU: the sglang line (default: the newest with a series)")
    parser.add_argument("--wheel", type=Path, help="GPU: the patched wheel (installed in this venv)")
    parser.add_argument(
        "--pristine-wheel", type=Path, help="GPU: the official wheel (default: from the provenance)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--models", default=None, help="GPU: dense,hybrid; CPU: dense,lfm2,gdn (default: all)"
    )
    parser.add_argument(
        "--runs",
        default=None,
        help="CPU: which runs, in the order of CPU_PLAN, or `all` (default: the default run's)",
    )
    parser.add_argument("--python", default=sys.executable, help="GPU: the interpreter that runs the servers")
    parser.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S)
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S, help="a run's traffic, at most")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARRY_E2E_")}
    try:
        if args.device == "cpu":
            prepared = plan_cpu(args.runs, args.models, args.upstream, out, env)
        else:
            prepared = plan_gpu(args.wheel, args.pristine_wheel, args.models, args.python, out, env)
    except PlanError as error:
        print(f"e2e: error: {error}", file=sys.stderr)
        return 2
    model_dirs = write_models(out / "models", [plan.model for plan in prepared.plans])
    try:
        with servers_killed_on_interrupt():
            runs = run_plans(
                prepared.plans,
                model_dirs,
                out,
                prepared.env,
                run_timeout_s=args.run_timeout_s,
                request_timeout_s=args.request_timeout_s,
            )
    except (KeyboardInterrupt, Terminated) as stop:
        signal_name, status = interrupted_exit(stop)
        print(
            f"e2e: error: stopped by {signal_name}; its servers were killed, no report was written "
            f"(the runs' logs are in {out}): run it again",
            file=sys.stderr,
        )
        return status
    publish(out, {"device": args.device, **prepared.report}, runs)
    return 0 if runs and all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
