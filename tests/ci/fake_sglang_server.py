"""A stand-in for `python -m sglang.launch_server` in the e2e driver's CPU tests.

    fake_sglang_server.py PORT MODE [--child-pid-file F]

Serves /health and /generate on 127.0.0.1 like sglang with --skip-tokenizer-init and
--enable-cache-report: greedy "output_ids" derived from the input ids, meta_info with
finish_reason, cached_tokens and cached_tokens_details.host (a prefix seen before counts as a host
hit). It writes the counters the injection hook would (CARRY_E2E_COUNTERS_DIR: rank 0's, and with
--tp 2 rank 1's too), misses only on the ranks CARRY_E2E_MISS_RANKS names, counts a withheld
reading per request on the ranks CARRY_E2E_WITHHOLD_RANKS names when CARRY_E2E_WITHHELD_TOKENS is
set (as the hook does while the scheduler is busy); with CARRY_E2E_MISS_AT=decode the ranks that
recover count decode retractions instead of unwinds; and per MODE:
- control:  no miss;
- no-miss:  no miss even when misses are asked for (a hook that injects nothing);
- pristine: the first request of the second wave "misses": the missing rank's scheduler records
  the allocation error (raised in sglang/srt/mem_cache/allocation.py) and the whole server exits
  (as sglang does when its scheduler dies);
- other-death: like pristine, but the scheduler died of something else (raised elsewhere);
- survivor: misses, and survives without unwinding (a pristine sglang that fixed the bug);
- patched:  misses, every rank unwinds (and logs it), answers everything;
- one-rank-unwinds: like patched, but only the missing rank unwinds;
- skewed:   like patched, but its outputs differ from the control run's (as a tree without the
  load wait does);
- abort:    like patched, but the first request that missed is aborted (finish_reason abort);
- no-withhold: like patched, but nothing is withheld even when asked (a hook that reduced nothing);
- no-drift: like patched, but a drifting withholding withholds one amount throughout;
- hang:     misses, then never answers the request that missed (a rank waiting in a collective);
- natural-pristine: no miss is injected, yet the first request's scheduler dies of the allocation
  error on every rank (upstream's own miss) and the server exits;
- natural-patched: no miss is injected, yet the first request is put back once on every rank
  (counted per rid too), and everything is answered;
- late-copies: like patched, and (with CARRY_E2E_MAMBA=1) every Mamba load copy lands late;
- no-mamba-loads: like control, but (with CARRY_E2E_MAMBA=1) no Mamba state is loaded;
- no-prefetch: like patched, but nothing is prefetched from HiCache's L3 tier;
- metrics-undercount: like patched, but /metrics shows one event fewer on the last rank than its
  counters (a series counter not incremented where the event happened);
- no-metrics: like patched, but /metrics answers 404 (a server started without --enable-metrics).
/metrics shows each rank's counters as the series' Prometheus counters (tp_rank labels, Prometheus
text with its HELP, TYPE and _created lines).
With SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR set (HiCache's L3 tier on; the folder must exist) a
host hit is reported as read from storage (cached_tokens_details.storage), and every rank counts a
prefetch started and a termination check for it.
With CARRY_E2E_MAMBA=1 every host hit lands MAMBA_COPIES_PER_HIT Mamba load copies on every rank
(as the hybrid stand-ins count them), except in no-mamba-loads.
With --child-pid-file it starts a child in its own process group (a scheduler) and records its PID.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PORT, MODE = int(sys.argv[1]), sys.argv[2]
TP = int(sys.argv[sys.argv.index("--tp") + 1]) if "--tp" in sys.argv else 1
seen_prefixes: set[tuple[int, ...]] = set()
counts = {
    rank: {
        "eligible_allocations": 0,
        "injected_misses": 0,
        "loads_started": 0,
        "unwinds": 0,
        "withheld_readings": 0,
        "decode_retractions": 0,
        "withheld_amounts": 0,
        "parked_chunk_releases": 0,
    }
    for rank in range(TP)
}
# What a rank that recovers from a miss counts: a prefill unwind, or a retraction after a decode miss.
recovery = "decode_retractions" if os.environ.get("CARRY_E2E_MISS_AT") == "decode" else "unwinds"
died_with: dict[int, dict[str, str]] = {}
unwound_rids: dict[int, dict[str, int]] = {rank: {} for rank in range(TP)}
natural_missed = [False]
lock = threading.Lock()
limit = int(os.environ.get("CARRY_E2E_MISS_LIMIT", "0"))
ranks = os.environ.get("CARRY_E2E_MISS_RANKS", "")
miss_ranks = [int(r) for r in ranks.split(",")] if ranks else list(range(TP))
withheld_tokens = int(os.environ.get("CARRY_E2E_WITHHELD_TOKENS", "0"))
withholding = os.environ.get("CARRY_E2E_WITHHOLD_RANKS", "")
withhold_ranks = [int(r) for r in withholding.split(",")] if withholding else list(range(TP))
PATCHED_MODES = (
    "patched",
    "skewed",
    "one-rank-unwinds",
    "abort",
    "no-withhold",
    "no-drift",
    "late-copies",
    "no-prefetch",
    "metrics-undercount",
    "no-metrics",
)
# The hook's counters and the series' Prometheus counters of the same events.
METRICS = {
    "unwinds": "sglang:num_prefill_unwinds_total",
    "decode_retractions": "sglang:num_decode_allocation_misses_total",
    "parked_chunk_releases": "sglang:num_parked_chunk_releases_total",
}
# HiCache's L3 tier (the file backend), in the folder the run gave it.
STORAGE_DIR = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
assert STORAGE_DIR is None or Path(STORAGE_DIR).is_dir(), STORAGE_DIR
MAMBA = os.environ.get("CARRY_E2E_MAMBA") == "1"
MAMBA_COPIES_PER_HIT = 3
if MAMBA:
    for rank_counts in counts.values():
        rank_counts |= {"mamba_copies_landed": 0, "mamba_late_copies": 0}
ALLOCATION_ERROR = {
    "type": "RuntimeError",
    "message": "Out of memory. Try to lower your batch size.",
    "raised_in": "/x/python/sglang/srt/mem_cache/allocation.py:alloc_token_slots",
}
OTHER_ERROR = {"type": "RuntimeError", "message": "Connection closed by peer", "raised_in": "/x/gloo.py:wait"}


def save_counters() -> None:
    folder = os.environ.get("CARRY_E2E_COUNTERS_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        # As the real hook does: the driver may read the folder (and kill this process) at any
        # moment, so it must never see a half-written file. One file per rank's "scheduler".
        for rank, rank_counts in counts.items():
            target = Path(folder) / f"{os.getpid()}-{rank}.json"
            temporary = target.with_suffix(".tmp")
            record = {
                "rank": rank,
                **rank_counts,
                "unwound_rids": unwound_rids[rank],
                "died_with": died_with.get(rank),
            }
            temporary.write_text(json.dumps(record))
            temporary.replace(target)


def metrics_page() -> str:
    lines = []
    with lock:
        for counter, metric in METRICS.items():
            lines += [f"# HELP {metric} The series' counter.", f"# TYPE {metric} counter"]
            for rank, rank_counts in counts.items():
                value = rank_counts.get(counter, 0)
                if MODE == "metrics-undercount" and rank == TP - 1 and value:
                    value -= 1
                labels = f'model_name="fake",engine_type="unified",tp_rank="{rank}",pp_rank="0"'
                lines += [f"{metric}{{{labels}}} {float(value)}", f"{metric}_created{{{labels}}} 1.7e+09"]
    return "\n".join(lines) + "\n"


def log(line: str) -> None:
    print(line, flush=True)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/metrics" and MODE != "no-metrics":
            data = metrics_page().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._answer(200 if self.path == "/health" else 404, {})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids: list[int] = request["input_ids"]
        prefix = tuple(ids[:256])
        missing = counts[miss_ranks[0]]
        with lock:
            host_hit = prefix in seen_prefixes
            seen_prefixes.add(prefix)
            missed = aborted = False
            if withheld_tokens > 0 and MODE != "no-withhold":
                for rank in withhold_ranks:
                    counts[rank]["withheld_readings"] += 1
                    # A drifting reading takes a new amount each time (up to four); a steady one one.
                    drifting = os.environ.get("CARRY_E2E_WITHHELD_DRIFT") == "1" and MODE != "no-drift"
                    readings = counts[rank]["withheld_readings"]
                    counts[rank]["withheld_amounts"] = min(4, readings) if drifting else 1
            if host_hit:
                for rank_counts in counts.values():
                    if STORAGE_DIR is not None and MODE != "no-prefetch":
                        rank_counts["prefetches_started"] = rank_counts.get("prefetches_started", 0) + 1
                        checks = rank_counts.get("prefetch_termination_checks", 0) + 1
                        rank_counts["prefetch_termination_checks"] = checks
                    rank_counts["loads_started"] += 1
                    rank_counts["eligible_allocations"] += 1
                    if MAMBA and MODE != "no-mamba-loads":
                        rank_counts["mamba_copies_landed"] += MAMBA_COPIES_PER_HIT
                        if MODE == "late-copies":
                            rank_counts["mamba_late_copies"] += MAMBA_COPIES_PER_HIT
                if MODE != "no-miss" and missing["injected_misses"] < limit:
                    missing["injected_misses"] += 1
                    missed = True
                    # Decided under the lock: a concurrent request may count the next miss first.
                    aborted = MODE == "abort" and missing["injected_misses"] == 1
            natural = MODE.startswith("natural-") and not natural_missed[0]
            natural_missed[0] = natural_missed[0] or MODE.startswith("natural-")
            if natural and MODE == "natural-pristine":
                died_with.update(dict.fromkeys(counts, ALLOCATION_ERROR))
            if natural and MODE == "natural-patched":
                for rank in counts:
                    counts[rank]["unwinds"] += 1
                    unwound_rids[rank][request.get("rid", "")] = 1
            if missed and MODE in ("pristine", "other-death"):
                died_with[miss_ranks[0]] = ALLOCATION_ERROR if MODE == "pristine" else OTHER_ERROR
            if missed and MODE in PATCHED_MODES:
                unwound = [miss_ranks[0]] if MODE == "one-rank-unwinds" else list(counts)
                for rank in unwound:
                    counts[rank][recovery] += 1
            save_counters()
        if (missed and MODE in ("pristine", "other-death")) or (natural and MODE == "natural-pristine"):
            log("Scheduler hit an exception")
            os._exit(1)
        if missed and MODE == "hang":
            threading.Event().wait()  # the driver's request timeout ends it
        if missed and MODE in PATCHED_MODES:
            log("Prefill allocation missed; unwound 1 batch(es) since the last report")
        n = request["sampling_params"]["max_new_tokens"]
        salt = 7 if MODE == "skewed" else 0
        output = [(sum(ids) + salt + i) % 1000 for i in range(n)]
        finish = {"type": "abort", "message": "aborted"} if aborted else {"type": "length", "length": n}
        details = {"device": 0, "host": 256 if host_hit else 0}
        if STORAGE_DIR is not None:
            prefetched = host_hit and MODE != "no-prefetch"
            details["storage"] = 256 if prefetched else 0
        cached = 256 if host_hit else 0
        meta = {"finish_reason": finish, "cached_tokens": cached, "cached_tokens_details": details}
        self._answer(200, {"output_ids": output, "meta_info": meta})


if "--child-pid-file" in sys.argv:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(sys.argv[sys.argv.index("--child-pid-file") + 1]).write_text(str(child.pid))
log(f"fake server {MODE} on {PORT}")
ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
