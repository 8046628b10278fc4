"""Benchmark: patched vs pristine `Scheduler._get_new_batch_prefill_raw` on a batch that allocates.

Not a test: it prints the median time of one prefill round on each tree and the ratio
patched/pristine, which the carried unwind must keep at or under 1.02. Both trees run the same
CPU harness (tests/upstream/sglang/scheduler_harness.py) in two worker processes, driven in
alternating blocks in the same run so machine load drifts hit both alike.

    .venv-test/bin/python ci/bench/prefill_unwind.py [--rounds 3000] [--block 100] [--config mamba]

Trees: worktrees of upstream/sglang at upstream/<version> and carry/<version>, made under build/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sglang_carry.git import Git

ROOT = Path(__file__).resolve().parents[2]
HARNESS_DIR = ROOT / "tests" / "upstream" / "sglang"
CONFIGS = {
    "page1": {},
    "page4": {"page_size": 4},
    "mamba": {"mamba": True, "ping_pong": True},
    "hicache": {"hicache": True},
}
HOST_PREFIX = list(range(100, 132))

WORKER = r"""
import json, logging, os, sys, time
# Both workers on the same core, one running at a time: no migration, same caches.
os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
sys.path.insert(0, sys.argv[1])
import scheduler_harness as sh
logging.disable(logging.WARNING)
config = json.loads(sys.argv[2])
prefix = json.loads(sys.argv[3])
harness = sh.build_harness(**config)
print("ready", flush=True)
for line in sys.stdin:
    rounds = int(line)
    times = []
    for _ in range(rounds):
        harness.reset()
        if harness.cfg.hicache:
            harness.put_prefix_on_host(prefix)
            harness.add_request(prefix + [1, 2, 3])
        for i in range(3):
            harness.add_request(list(range(10 + 50 * i, 30 + 50 * i)))
        start = time.perf_counter()
        batch = harness.run_round()
        times.append(time.perf_counter() - start)
        assert batch is not None and len(batch.reqs) >= 3, "the benchmark batch must allocate"
    print(json.dumps(times), flush=True)
"""


def worktree(tree: str, ref: str) -> Path:
    checkout = Git(ROOT / "upstream" / "sglang")
    return checkout.fresh_worktree(ROOT / "build" / "bench" / tree, ref) / "python"


def start_worker(tree: Path, config: dict[str, object]) -> subprocess.Popen[str]:
    env = {**os.environ, "CARRY_TREE_SGLANG": str(tree), "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(HARNESS_DIR), json.dumps(config), json.dumps(HOST_PREFIX)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def run_block(proc: subprocess.Popen[str], rounds: int) -> list[float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{rounds}\n")
    proc.stdin.flush()
    times: list[float] = json.loads(proc.stdout.readline())
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", default="0.5.20")
    parser.add_argument("--rounds", type=int, default=4000, help="timed rounds per tree")
    parser.add_argument("--block", type=int, default=25, help="rounds per alternating block")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="mamba")
    args = parser.parse_args()

    trees = {
        "pristine": worktree("pristine", f"upstream/{args.version}"),
        "patched": worktree("patched", f"carry/{args.version}"),
    }
    print(f"bench: starting one worker per tree ({args.config}); importing sglang takes a while", flush=True)
    workers = {name: start_worker(tree, CONFIGS[args.config]) for name, tree in trees.items()}
    try:
        for proc in workers.values():
            run_block(proc, args.warmup)
        samples: dict[str, list[float]] = {name: [] for name in workers}
        started = time.monotonic()
        order = list(workers)
        while len(samples["patched"]) < args.rounds:
            for name in order:
                samples[name].extend(run_block(workers[name], args.block))
            order.reverse()
            done = len(samples["patched"])
            if done % 1000 == 0:
                elapsed = time.monotonic() - started
                print(f"bench: {done}/{args.rounds} rounds per tree ({elapsed:.0f} s)", flush=True)
    finally:
        for proc in workers.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=60)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    for name, median in medians.items():
        print(f"{name:9s} median {median * 1e3:.4f} ms over {len(samples[name])} rounds")
    ratio = medians["patched"] / medians["pristine"]
    print(f"patched/pristine median ratio: {ratio:.4f} (target <= 1.02)")
    return 0 if ratio <= 1.02 else 1


if __name__ == "__main__":
    sys.exit(main())
