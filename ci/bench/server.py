"""Benchmark: what the series costs a real sglang server (on CPU, or on a GPU), and what recovering
from a natural miss costs.

    .venv-test/bin/python ci/bench/server.py [--upstream V] [--pairs 6] [--repeats 2]
        [--judge in-run] [--out DIR]
    GPU_PYTHON ci/bench/server.py --device cuda --wheel PATCHED_WHEEL [--python GPU_PYTHON]

Not a test. On CPU the line is prepared as the CPU end-to-end test prepares it
(ci/e2e/cpu_line.py: the official wheel from the pin, the patched wheel from dist/, built if
missing) and served by the line's test environment with the same CPU stand-ins and model
(ci/e2e/run_e2e.py). With --device cuda (the GPU nightly's `bench` step) the patched wheel and the
official one it was built from are each unpacked and served by --python (a venv with the line's
requirements: ci/gpu-env), both servers of a case on the same GPU(s); a case that needs more GPUs
than `nvidia-smi -L` lists is skipped, and said so. The judge defaults to the wall clock there.

1. The series' cost, nothing missing: for each of CASES a pristine and a patched server run side
   by side, both with `--sleep-on-idle` so that the one not being timed sleeps on its sockets
   (0.04 of a core measured with two ranks, against 1.4 cores spinning without it), and the timed
   passes alternate between them in ABBA order (pristine, patched, patched, pristine, ...),
   `--pairs` passes each. The pair of passes i sends both servers the same traffic (PASS_REQUESTS
   greedy requests, ONE_RANK_PASS_REQUESTS with one rank; random prompts of PROMPT_TOKENS_MIN..MAX
   tokens, OUTPUT_TOKENS new tokens each, CONCURRENCY in flight, streamed), prompts no earlier
   pass sent (nothing is served from the prefix cache). Alternating passes on live servers pairs
   them in time: this machine's speed drifts by up to 2x over minutes, which a server per wheel
   started minutes apart measured as noise. The cases: one rank; two ranks whose KV pool is marked
   rank-local (as a kvcached pool is: the patched ranks then agree on every admitting prefill
   round and vote on every decode step, the agreement's real cost); two ranks with a plain pool
   (no agreement); and a control, two ranks serving the pristine wheel twice, whose ratios are
   what this run's noise alone makes of a ratio (printed, and named when over a target, but not a
   failure of the series). Per wheel, over all its passes pooled: requests/s, output tokens/s,
   time to first token and end-to-end latency (median, p99), and from the hook in rank 0's
   scheduler the decode steps, the agreement's all-reduces and the wall time spent inside them
   (per all-reduce, and as a share of the timed time: at most what the agreement costs, as part of
   it is waiting for the slower rank, which the forward's own all-reduce would wait for
   otherwise); the ratio patched/pristine, and each pair's throughput ratio (its spread is the
   noise). What decides the exit status (--judge): `in-run` (default on CPU), the agreement's time in
   each patched pass at most 1 % of the pass with a rank-local pool and no agreement collective
   at all otherwise, which a shared 2-core machine can decide; `wall-clock`, the ratios'
   targets (throughput >= 0.98, p99 TTFT <= 1.05, every case but the control), for a quiet
   machine (default with --device cuda). Under `in-run` a missed wall-clock target is printed, not
   failed.
2. Recovery from a natural miss (NATURAL in ci/e2e/e2e_harness/scenarios.py): the patched server
   on the natural traffic next to the same traffic on a pool large enough not to miss, a server
   per pass, `--repeats` of each: wall time, latency median and p99, and their ratios (printed,
   no target: the price of not crashing).

Prints a table last, writes report.json to --out. Exit 0 when every judged target holds, 1 when
one does not, 2 when the line cannot be prepared or a server does not serve the traffic.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))

import cpu_line  # noqa: E402  (puts the tool's package on sys.path)
from cpu_line import unpack_wheel  # noqa: E402
from e2e_harness.models import VOCAB, write_models  # noqa: E402
from e2e_harness.plan import official_wheel_of  # noqa: E402
from e2e_harness.scenarios import NATURAL_POOL_TOKENS, NATURAL_ROOMY_POOL_TOKENS, natural_flags  # noqa: E402
from e2e_harness.server import (  # noqa: E402
    CPU_FLAGS,
    CPU_STANDINS,
    HOOK,
    HOST,
    ROOT,
    Server,
    Terminated,
    cpu_env,
    free_port,
    interrupted_exit,
    server_command,
    servers_killed_on_interrupt,
)
from e2e_harness.traffic import MAX_NEW_TOKENS, Request, plan_natural_traffic  # noqa: E402
from e2e_harness.verdicts import read_counters  # noqa: E402

from sglang_carry.errors import CarryError  # noqa: E402
from sglang_carry.kinds.wheel import Wheel  # noqa: E402

# Requests per timed pass: about 10 s of two ranks' serving; one rank serves 8x faster, and a
# pass of 1 s was mostly its ramp up and down, so its passes are 4x longer.
PASS_REQUESTS = 48
ONE_RANK_PASS_REQUESTS = 4 * PASS_REQUESTS
PROMPT_TOKENS_MIN, PROMPT_TOKENS_MAX = 64, 256
OUTPUT_TOKENS = 32
CONCURRENCY = 8
# A pool every request of the traffic fits in at once: nothing misses, nothing is retracted.
POOL_FLAGS = (
    "--max-total-tokens",
    "16384",
    "--page-size",
    "1",
    "--chunked-prefill-size",
    "1024",
    "--max-running-requests",
    "16",
)
# The server not being timed sleeps on its sockets instead of spinning (the same on both wheels).
SIDE_BY_SIDE_FLAGS: tuple[str, ...] = (*POOL_FLAGS, "--sleep-on-idle")
THROUGHPUT_TARGET = 0.98
TTFT_P99_TARGET = 1.05
# The series' own cost measured inside the run: the time rank 0's scheduler spends in the
# agreement's collectives, as a share of each timed pass of the patched server. At most this with a
# rank-local pool; none at all (not one collective) with a plain pool or one rank.
AGREEMENT_SHARE_TARGET = 0.01
# What decides the exit status: the in-run share (what a shared 2-core machine can decide), or the
# wall-clock A/B (throughput and p99 TTFT ratios: for a quiet machine, such as the GPU nightly's).
JUDGES = ("in-run", "wall-clock")
REQUEST_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 900.0
# Starts of one server whose port another process bound first.
PORT_ATTEMPTS = 3
# Two CPU ranks need their OpenMP cores named (sglang's CPU engine).
TWO_RANK_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
# On a GPU, server_command's own flags: each server takes 0.3 of a GPU's memory, so a case's two
# servers share the same GPU(s) (the model is tiny, the pool capped by POOL_FLAGS).
GPU_FLAGS: tuple[str, ...] = ()
DEVICES = ("cpu", "cuda")
# The judge a device gets unless --judge names one: a GPU runner is quiet enough for the ratios.
DEFAULT_JUDGE = {"cpu": "in-run", "cuda": "wall-clock"}
# name, ranks, the pool marked rank-local (the patched ranks then agree), the two servers' wheels,
# what it is. The control serves the pristine wheel twice: its ratios are this run's noise.
CASES = (
    ("tp1", 1, False, ("pristine", "patched"), "one rank"),
    ("tp2", 2, True, ("pristine", "patched"), "two ranks, rank-local pool: the agreement's cost"),
    ("tp2-plain", 2, False, ("pristine", "patched"), "two ranks, plain pool: no agreement"),
    ("tp2-control", 2, True, ("pristine", "pristine"), "two ranks, pristine against pristine: the noise"),
)
# The second server of a pair, by what it serves.
SECOND = {"patched": "patched", "pristine": "pristine again"}


@dataclass
class Served:
    """One server's pass over the traffic."""

    tree: str
    seconds: float
    requests: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    failed: int = 0
    # From the hook in rank 0's scheduler, during the timed traffic: decode steps, the carried
    # agreement's all-reduces, prefill unwinds.
    decode_steps: int = 0
    agreement_all_reduces: int = 0
    agreement_us: int = 0
    unwinds: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summary(served: Served) -> dict[str, float]:
    return {
        "requests_per_s": served.requests_per_s,
        "output_tokens_per_s": served.output_tokens_per_s,
        "ttft_median_ms": 1000 * statistics.median(served.ttft_s),
        "ttft_p99_ms": 1000 * percentile(served.ttft_s, 0.99),
        "latency_median_ms": 1000 * statistics.median(served.latency_s),
        "latency_p99_ms": 1000 * percentile(served.latency_s, 0.99),
        "seconds": served.seconds,
        "decode_steps": served.decode_steps,
        "agreement_all_reduces": served.agreement_all_reduces,
        "agreement_us_per_all_reduce": served.agreement_us / max(1, served.agreement_all_reduces),
        "agreement_share_of_pass": served.agreement_us / (1e6 * served.seconds),
        "unwinds": served.unwinds,
    }


def rank0_counts(folder: Path) -> dict[str, int]:
    """The hook's counters of rank 0's scheduler (after a moment: it saves within 0.5 s)."""
    time.sleep(1.0)
    for record in read_counters(folder):
        if record.get("rank", 0) == 0 and "decode_steps" in record:
            return {key: int(record.get(key, 0)) for key in HOOK_COUNTERS}
    return dict.fromkeys(HOOK_COUNTERS, 0)


def plan_bench_traffic(seed: int, requests: int = PASS_REQUESTS) -> list[Request]:
    """One pass's traffic. Each pass has a seed of its own, so no pass repeats an earlier prompt."""
    rng = random.Random(seed)
    return [
        Request(
            f"bench.{seed}.{i}",
            [rng.randrange(3, VOCAB) for _ in range(rng.randint(PROMPT_TOKENS_MIN, PROMPT_TOKENS_MAX))],
        )
        for i in range(requests)
    ]


def pass_order(pairs: int, first: str = "pristine", second: str = "patched") -> list[tuple[int, str]]:
    """(pair, server) in ABBA order: each server goes first in every other pair, so a drift of the
    machine's speed over the run weighs on both alike."""
    order: list[tuple[int, str]] = []
    for pair in range(pairs):
        servers = (first, second) if pair % 2 == 0 else (second, first)
        order += [(pair, server) for server in servers]
    return order


def pooled(passes: Sequence[Served]) -> Served:
    """One wheel's passes as one: requests and time summed, every request's TTFT and latency."""
    whole = Served(passes[0].tree, 0.0, 0, 0)
    for served in passes:
        whole.seconds += served.seconds
        whole.requests += served.requests
        whole.output_tokens += served.output_tokens
        whole.ttft_s += served.ttft_s
        whole.latency_s += served.latency_s
        whole.failed += served.failed
        for key in HOOK_COUNTERS:
            setattr(whole, key, getattr(whole, key) + getattr(served, key))
    return whole


def pair_throughput_ratios(runs: dict[str, list[Served]]) -> list[float]:
    """Each pair's second server's throughput over its first's (runs: two servers' passes, in
    pair order)."""
    first, second = runs.values()
    return [b.requests_per_s / a.requests_per_s for a, b in zip(first, second, strict=True)]


def stream(port: int, request: Request, max_new_tokens: int) -> tuple[float, float, int]:
    """Send one streamed greedy request; (time to first token, end-to-end latency, output tokens).
    Raises OSError / ValueError when the server does not serve it."""
    time.sleep(request.send_after_s)
    body = json.dumps(
        {
            "input_ids": request.input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
        }
    )
    connection = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_S)
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    finished = False
    try:
        connection.request("POST", "/generate", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            if first is None and chunk.get("output_ids"):
                first = time.perf_counter() - start
            meta = chunk.get("meta_info") or {}
            tokens = int(meta.get("completion_tokens", tokens))
            finish = meta.get("finish_reason") or {}
            finished = finished or (isinstance(finish, dict) and finish.get("type") in ("length", "stop"))
    finally:
        connection.close()
    if first is None or not finished:
        raise ValueError("the stream ended unfinished")
    return first, time.perf_counter() - start, tokens


def serve_traffic(
    tree: str, port: int, requests: Sequence[Request], max_new_tokens: int, concurrency: int
) -> Served:
    """Every request, `concurrency` in flight; the wall time from the first send to the last answer."""
    served = Served(tree, 0.0, len(requests), 0)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(stream, port, request, max_new_tokens) for request in requests]
        for future in futures:
            try:
                ttft, latency, tokens = future.result()
            except (OSError, ValueError, http.client.HTTPException):
                served.failed += 1
                continue
            served.ttft_s.append(ttft)
            served.latency_s.append(latency)
            served.output_tokens += tokens
    served.seconds = time.perf_counter() - start
    return served


@dataclass(frozen=True)
class Case:
    name: str
    tp: int
    rank_local: bool
    flags: tuple[str, ...]
    requests: tuple[Request, ...]
    max_new_tokens: int
    concurrency: int
    pass_requests: int = PASS_REQUESTS
    device: str = "cpu"


@dataclass
class Running:
    """A server up and healthy, and where its rank 0's hook writes its counters."""

    case: Case
    tree: str
    server: Server
    port: int
    counters: Path

    def timed_pass(self, requests: Sequence[Request]) -> Served:
        before = rank0_counts(self.counters)
        served = serve_traffic(
            self.tree, self.port, requests, self.case.max_new_tokens, self.case.concurrency
        )
        after = rank0_counts(self.counters)
        for key in HOOK_COUNTERS:
            setattr(served, key, after[key] - before[key])
        if served.failed:
            raise RuntimeError(
                f"{self.case.name} on {self.tree}: {served.failed} request(s) not served"
                f" (see {self.server.log})"
            )
        return served


def launch(
    case: Case,
    tree: str,
    site: Path,
    python: Path,
    pythonpath: Sequence[Path],
    model: Path,
    out: Path,
    env: dict[str, str],
) -> Running:
    """Start a server (not yet healthy: see `ready`)."""
    port = free_port()
    device_flags = CPU_FLAGS if case.device == "cpu" else GPU_FLAGS
    extra = [*device_flags, *(["--tp-size", str(case.tp)] if case.tp > 1 else [])]
    command = server_command(str(python), model, port, extra, case.flags)
    server_env = dict(env)
    path = [str(site), *map(str, pythonpath), str(HOOK)]
    server_env["PYTHONPATH"] = os.pathsep.join(path)
    # The hook injects nothing (limit 0); with two ranks it marks the pool rank-local.
    stamp = f"{case.name}-{tree.replace(' ', '-')}-{time.strftime('%H%M%S')}"
    counters = out / "counters" / stamp
    server_env |= {
        "CARRY_E2E_INJECT": "1",
        "CARRY_E2E_MISS_LIMIT": "0",
        "CARRY_E2E_COUNTERS_DIR": str(counters),
    }
    if case.tp > 1 and case.device == "cpu":
        server_env |= TWO_RANK_ENV
    if case.rank_local:
        server_env["CARRY_E2E_RANK_LOCAL"] = "1"
    server = Server.start(command, server_env, out / "logs" / f"{stamp}.log", port)
    return Running(case, tree, server, port, counters)


def start_healthy(case: Case, tree: str, site: Path, *where: Any) -> Running:
    """Start a server and wait until it is healthy. Its port is picked free before the server
    binds it, and the other server side by side binds ports of its own meanwhile: a server that
    found its port taken is started again on another, up to PORT_ATTEMPTS times."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        running = launch(case, tree, site, *where)
        if running.server.wait_healthy(STARTUP_TIMEOUT_S):
            return running
        running.server.stop()
        if not running.server.port_taken() or attempt == PORT_ATTEMPTS:
            break
    raise RuntimeError(f"{case.name} on {tree}: the server never became healthy (see {running.server.log})")


def warm(running: Running, warm_up: Sequence[Request]) -> None:
    """Serve the warm-up (prompts no timed pass sends)."""
    serve_traffic(running.tree, running.port, warm_up, running.case.max_new_tokens, running.case.concurrency)


def run_server(case: Case, tree: str, *where: Any) -> Served:
    """One server, one timed pass (the natural traffic's recovery)."""
    running = start_healthy(case, tree, *where)
    try:
        warm(running, WARM_UP)
        return running.timed_pass(case.requests)
    finally:
        running.server.stop()


def side_by_side(case: Case, pairs: int, sites: dict[str, Path], *where: Any) -> dict[str, list[Served]]:
    """Two servers up together, one per entry of `sites` (what it serves: its site), in that
    order; `pairs` timed passes each, alternating."""
    servers: dict[str, Running] = {}
    runs: dict[str, list[Served]] = {name: [] for name in sites}
    try:
        for name, site in sites.items():
            servers[name] = start_healthy(case, name, site, *where)
        warm_up = plan_bench_traffic(WARM_UP_SEED, case.pass_requests)
        for running in servers.values():
            warm(running, warm_up)
        for pair, tree in pass_order(pairs, *sites):
            served = servers[tree].timed_pass(plan_bench_traffic(FIRST_TIMED_SEED + pair, case.pass_requests))
            runs[tree].append(served)
            print(
                f"bench: {case.name} pass {pair + 1}/{pairs} {tree}:"
                f" {served.requests_per_s:.2f} req/s, {served.output_tokens_per_s:.1f} tok/s",
                flush=True,
            )
    finally:
        for running in servers.values():
            running.server.stop()
    return runs


def over_target(case: str, ratios: dict[str, float]) -> list[str]:
    """What of a case's patched/pristine ratios misses its target, one line each."""
    failures = []
    if ratios["requests_per_s"] < THROUGHPUT_TARGET:
        failures.append(f"{case}: throughput ratio {ratios['requests_per_s']:.4f} < {THROUGHPUT_TARGET}")
    if ratios["ttft_p99_ms"] > TTFT_P99_TARGET:
        failures.append(f"{case}: p99 TTFT ratio {ratios['ttft_p99_ms']:.4f} > {TTFT_P99_TARGET}")
    return failures


def misses_by_kind(
    case: str, wheels: tuple[str, str], ratios: dict[str, float]
) -> tuple[list[str], list[str]]:
    """(the series' misses, the noise's): a case serving one wheel twice (the control) can only
    miss by noise, which must not fail the run."""
    missed = over_target(case, ratios)
    return ([], missed) if wheels[0] == wheels[1] else (missed, [])


def agreement_shares(passes: Sequence[Served]) -> list[float]:
    """Each timed pass's time inside the agreement's collectives (rank 0), as a share of the pass."""
    return [served.agreement_us / (1e6 * served.seconds) for served in passes]


def over_in_run_target(case: str, rank_local: bool, patched_passes: Sequence[Served]) -> list[str]:
    """What of the patched server's in-run cost misses its target, one line each: with a rank-local
    pool a pass whose share is over AGREEMENT_SHARE_TARGET; otherwise any pass that made a
    collective at all."""
    failures = []
    for number, (served, share) in enumerate(
        zip(patched_passes, agreement_shares(patched_passes), strict=True), 1
    ):
        if rank_local and share > AGREEMENT_SHARE_TARGET:
            failures.append(
                f"{case}: pass {number}: the agreement took {100 * share:.2f} % of the pass"
                f" > {100 * AGREEMENT_SHARE_TARGET:.0f} %"
            )
        if not rank_local and served.agreement_all_reduces:
            failures.append(
                f"{case}: pass {number}: {served.agreement_all_reduces} agreement all-reduce(s) without a"
                " rank-local pool (none expected)"
            )
    return failures


def share_line(passes: Sequence[Served]) -> str:
    """The per-pass shares and their spread, as the table prints them."""
    shares = [100 * share for share in agreement_shares(passes)]
    spread = (
        f"; spread {min(shares):.2f}-{max(shares):.2f} %, stdev {statistics.pstdev(shares):.2f}"
        if shares
        else ""
    )
    return "  agreement % per pass    " + " ".join(f"{share:.2f}" for share in shares) + spread


WARM_UP_SEED, FIRST_TIMED_SEED = 0, 1
WARM_UP = plan_bench_traffic(WARM_UP_SEED)[:2]
# What is timed (a ratio is printed), and what is counted (rank 0, during the timed traffic).
TIMED = (
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_median_ms",
    "ttft_p99_ms",
    "latency_median_ms",
    "latency_p99_ms",
    "seconds",
)
COUNTED = ("decode_steps", "agreement_all_reduces", "unwinds")
# What a pass reads of rank 0's hook (the difference across the timed traffic).
HOOK_COUNTERS = (*COUNTED, "agreement_us")
# The time inside the agreement's all-reduces, per all-reduce (us) and as a share of the pass.
AGREEMENT_TIME = ("agreement_us_per_all_reduce", "agreement_share_of_pass")


def median_of(runs: Sequence[Served]) -> dict[str, float]:
    summaries = [summary(run) for run in runs]
    return {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}


@dataclass(frozen=True)
class Prepared:
    """What serves the traffic: the line, each wheel unpacked (its site), the interpreter, what goes
    on PYTHONPATH after a site, the servers' environment, and the GPUs present (None on CPU)."""

    version: str
    sites: dict[str, Path]
    python: Path
    pythonpath: list[Path]
    env: dict[str, str]
    gpus: int | None = None


def prepare_cpu(upstream: str | None, out: Path, base_env: dict[str, str]) -> Prepared:
    """As the CPU end-to-end test: the official wheel from the pin, the patched one from dist/ (built
    if missing), served by the line's test environment with the CPU stand-ins."""
    line = cpu_line.prepare(upstream, out)
    return Prepared(
        line.version,
        {
            "pristine": unpack_wheel(line.pristine_wheel, out / "sites" / "pristine", line.python),
            "patched": unpack_wheel(line.patched_wheel, out / "sites" / "patched", line.python),
        },
        line.python,
        [CPU_STANDINS, line.server_deps],
        cpu_env(base_env, out),
    )


def gpu_count() -> int:
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True, timeout=60)
    return sum(1 for row in listed.stdout.splitlines() if row.startswith("GPU "))


def prepare_gpu(wheel: Path, python: Path, out: Path, base_env: dict[str, str]) -> Prepared:
    """As the GPU end-to-end test: the patched wheel and the official one it was built from (its
    provenance, in upstream/.downloads), each unpacked, served by `python` (a venv with the line's
    requirements, see ci/gpu-env)."""
    pristine = official_wheel_of(wheel)
    if not pristine.is_file():
        raise FileNotFoundError(
            f"{pristine} (the official wheel {wheel.name} was built from): run `carry fetch sglang`"
        )
    return Prepared(
        str(Wheel().parse(pristine.name)[1]),
        {
            "pristine": unpack_wheel(pristine, out / "sites" / "pristine", python),
            "patched": unpack_wheel(wheel, out / "sites" / "patched", python),
        },
        python,
        [],
        {**base_env, "TORCH_EXTENSIONS_DIR": str(out / "torch-extensions")},
        gpu_count(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/bench/server.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--upstream", help="CPU: the sglang line (default: the newest with a series)")
    parser.add_argument(
        "--wheel", type=Path, help="GPU: the patched wheel (the official one from its provenance)"
    )
    parser.add_argument(
        "--python", type=Path, default=Path(sys.executable), help="GPU: the servers' interpreter"
    )
    parser.add_argument(
        "--pairs", type=int, default=6, help="timed passes per wheel and case, alternating (ABBA)"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="servers per pool for the natural traffic's recovery"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench-server")
    parser.add_argument(
        "--judge",
        choices=JUDGES,
        help="what decides the exit status: the agreement's share of each patched pass (the default on"
        " CPU), or the wall-clock ratios (a quiet machine: the default on a GPU)",
    )
    parser.add_argument(
        "--cases",
        default="tp1,tp2,tp2-plain,tp2-control,natural",
        help="which of tp1, tp2, tp2-plain, tp2-control, natural",
    )
    args = parser.parse_args(argv)
    args.judge = args.judge or DEFAULT_JUDGE[args.device]
    if args.device == "cuda" and args.wheel is None:
        parser.error("--wheel is required with --device cuda (the patched wheel)")
    out: Path = args.out.resolve()
    shutil.rmtree(out / "logs", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("CARRY_E2E_")}
    try:
        if args.device == "cpu":
            line = prepare_cpu(args.upstream, out, base_env)
        else:
            line = prepare_gpu(args.wheel.resolve(), args.python, out, base_env)
    except (
        CarryError,
        subprocess.SubprocessError,
        OSError,
        ValueError,
        zipfile.BadZipFile,
        StopIteration,
    ) as error:
        print(f"bench: error: the line cannot be prepared: {error}", file=sys.stderr)
        return 2
    sites, env, pythonpath = line.sites, line.env, line.pythonpath
    model = write_models(out / "models", ["dense"])["dense"]
    natural = tuple(plan_natural_traffic()[0])
    chosen = [c for c in args.cases.split(",") if c]
    report: dict[str, Any] = {
        "upstream": line.version,
        "pairs": args.pairs,
        "repeats": args.repeats,
        "judge": args.judge,
        "device": args.device,
        "cases": {},
    }
    lines: list[str] = []
    failures: list[str] = []
    # The control's own misses: what this run's noise alone does to a ratio.
    noise: list[str] = []
    # Under the in-run judgement, the wall-clock targets missed: printed, not failures.
    wall_clock_misses: list[str] = []
    try:
        with servers_killed_on_interrupt():
            for name, tp, rank_local, wheels, label in CASES:
                if name not in chosen:
                    continue
                if line.gpus is not None and tp > line.gpus:
                    report["cases"][name] = {"skipped": f"{tp} GPUs needed, {line.gpus} present"}
                    lines += [f"{name} ({label}): skipped, {tp} GPUs needed, {line.gpus} present"]
                    continue
                first, second = wheels
                case_sites = {first: sites[first], SECOND[second]: sites[second]}
                pass_requests = ONE_RANK_PASS_REQUESTS if tp == 1 else PASS_REQUESTS
                case = Case(
                    name,
                    tp,
                    rank_local,
                    SIDE_BY_SIDE_FLAGS,
                    (),
                    OUTPUT_TOKENS,
                    CONCURRENCY,
                    pass_requests,
                    args.device,
                )
                runs = side_by_side(case, args.pairs, case_sites, line.python, pythonpath, model, out, env)
                totals = {server: summary(pooled(served)) for server, served in runs.items()}
                ratios = {key: totals[SECOND[second]][key] / totals[first][key] for key in TIMED}
                pairs = pair_throughput_ratios(runs)
                report["cases"][case.name] = {
                    "pooled": totals,
                    "ratios": ratios,
                    "pair_throughput_ratios": pairs,
                    "passes": {tree: [summary(s) for s in served] for tree, served in runs.items()},
                }
                lines += [f"{case.name} ({label}): {args.pairs} passes per wheel, alternating, pooled"]
                lines += table_lines(totals, ratios)
                lines += [f"  {'pair throughput ratios':<22} " + " ".join(f"{r:.3f}" for r in pairs)]
                series_misses, noise_misses = misses_by_kind(case.name, wheels, ratios)
                noise += noise_misses
                if "patched" in runs:
                    in_run = over_in_run_target(case.name, rank_local, runs["patched"])
                    report["cases"][case.name]["agreement_shares"] = agreement_shares(runs["patched"])
                    lines += [share_line(runs["patched"])]
                    failures += in_run if args.judge == "in-run" else series_misses
                    wall_clock_misses += series_misses if args.judge == "in-run" else []
            if "natural" in chosen:
                pool_flags = {
                    "no miss": natural_flags(NATURAL_ROOMY_POOL_TOKENS),
                    "natural miss": natural_flags(NATURAL_POOL_TOKENS),
                }
                recovered: dict[str, list[Served]] = {name: [] for name in pool_flags}
                for _ in range(args.repeats):
                    for name, flags in pool_flags.items():
                        case = Case(
                            f"natural-{name.replace(' ', '-')}",
                            1,
                            False,
                            flags,
                            natural,
                            MAX_NEW_TOKENS,
                            len(natural),
                            device=args.device,
                        )
                        where = (sites["patched"], line.python, pythonpath, model, out, env)
                        recovered[name].append(run_server(case, "patched", *where))
                medians = {name: median_of(served) for name, served in recovered.items()}
                ratios = {key: medians["natural miss"][key] / medians["no miss"][key] for key in TIMED}
                report["cases"]["natural"] = {"medians": medians, "ratios": ratios}
                lines += ["natural traffic on the patched wheel: a pool that misses / one that does not"]
                lines += table_lines(medians, ratios)
    except RuntimeError as error:
        print(f"bench: error: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as stop:
        signal_name, status = interrupted_exit(stop)
        print(
            f"bench: error: stopped by {signal_name}; its servers were killed, no report was written",
            file=sys.stderr,
        )
        return status
    report["failures"] = failures
    report["noise"] = noise
    report["wall_clock_misses"] = wall_clock_misses
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(lines))
    for failure in failures:
        print(f"bench: over target: {failure}")
    for miss in wall_clock_misses:
        print(f"bench: wall clock over target (printed; judged by --judge wall-clock): {miss}")
    for miss in noise:
        print(f"bench: the control alone is over target (noise, not the series): {miss}")
    return 1 if failures else 0


def table_lines(medians: dict[str, dict[str, float]], ratios: dict[str, float]) -> list[str]:
    first, second = medians
    rows = [f"  {'':<22} {first:>12} {second:>12} {'ratio':>8}"]
    for key in TIMED:
        rows.append(
            f"  {key:<22} {medians[first][key]:>12.2f} {medians[second][key]:>12.2f} {ratios[key]:>8.4f}"
        )
    for key in COUNTED:
        rows.append(f"  {key:<22} {medians[first][key]:>12.0f} {medians[second][key]:>12.0f}")
    us, share = AGREEMENT_TIME
    rows.append(f"  {'agreement us each':<22} {medians[first][us]:>12.0f} {medians[second][us]:>12.0f}")
    first_share, second_share = 100 * medians[first][share], 100 * medians[second][share]
    rows.append(f"  {'agreement % of pass':<22} {first_share:>11.1f}% {second_share:>11.1f}%")
    return rows


if __name__ == "__main__":
    sys.exit(main())
