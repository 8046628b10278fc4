"""Benchmark: patched vs pristine `Scheduler._get_new_batch_prefill_raw` on a batch that allocates
(or, with --phase decode, `Scheduler.update_running_batch`: one decode step's preparation).

Not a test: it prints the median time of one prefill round on each tree and the ratio
patched/pristine, which the carried unwind must keep at or under 1.02. Both trees run the same
CPU harness (tests/upstream/sglang/scheduler_harness.py) in their own worker processes, driven in
rotating blocks in the same run so machine load drifts hit both alike; the pristine tree in two
processes, whose ratio (the same code) is the run's floor. The ratio is judged against 1.02 plus
the floor's distance from 1 (what the run can tell apart); a floor more than 5 % from 1 judges
nothing (exit 2: run it again on an idle machine).

    .venv-test/bin/python ci/bench/prefill_unwind.py [--rounds 3000] [--block 100] [--config mamba]
    .venv-test/bin/python ci/bench/prefill_unwind.py --ranks 2 [--before REF]
    .venv-test/bin/python ci/bench/prefill_unwind.py --ranks 2 --phase decode

With --ranks 2 each tree runs as two gloo ranks of one attention-TP group (one core each), once
with plain pools and once with an elastic pool (one whose free space is per rank, so the patched
scheduler agrees on every round that admits): the plain ratio must stay at or under 1.02; the
elastic pool's cost per round is printed next to one bare all-reduce of a few integers between
the same two ranks, timed in the same run, and every case prints the all-reduces its rounds made
(counted on rank 0; the agreement's target is one per round). --before REF times an earlier
series (a commit of upstream/sglang) alongside. --phase decode times a decode step of a running
batch of three requests instead (its prefill is not timed): the same targets, and with an elastic
pool the step's vote on its allocation (one all-reduce per decode step) next to the bare one.

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
from typing import NamedTuple

from sglang_carry.git import Git
from sglang_carry.project import Project, default_target

ROOT = Path(__file__).resolve().parents[2]
HARNESS_DIR = ROOT / "tests" / "upstream" / "sglang"
CONFIGS: dict[str, dict[str, object]] = {
    "page1": {},
    "page4": {"page_size": 4},
    "mamba": {"mamba": True, "ping_pong": True},
    "hicache": {"hicache": True},
}
HOST_PREFIX = list(range(100, 132))
# The pristine tree with one all-reduce placed where the patched round votes (two ranks: right
# after the batch's allocation), of about the vote's size.
PLACEBO: dict[str, object] = {"elastic": True, "placebo": True}
# Two ranks, decode: the elastic pool with every free token held mapped, so each timed step is
# one the decode credit covers (target: no all-reduce at all).
CREDITED: dict[str, object] = {"elastic": True, "mapped": 1_000_000}
# The patched tree's untimed prefill before a credited step votes (one all-reduce), and a gloo
# collective just before a timed step slows that step by some 25 us on this machine whatever the
# step does; so pristine's credited case makes one of the vote's size at the same point (untimed),
# and the ratio shows what the credit itself costs.
PER_CASE: dict[tuple[str, str], dict[str, object]] = {("pristine", "credited"): {"untimed_vote": True}}
PLAIN_TARGET = 1.02
# Past this, the run's two pristine processes read too far apart for the run to judge anything
# (the docs' up to 4 % on a quiet machine, and some room): exit 2, run it again.
FLOOR_LIMIT = 0.05
# The second process of the pristine tree (plain pools).
AGAIN = "pristine-again"
# The agreement's cost per round, in units of that placed all-reduce's.
AGREEMENT_TARGET = 1.2

WORKER = r"""
import datetime, json, logging, os, sys, time
rank, ranks, store = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
# One core per rank; every tree's rank r on the same core, one tree running at a time.
cores = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cores[-1 - rank % len(cores)]})
sys.path.insert(0, sys.argv[1])
import scheduler_harness as sh
logging.disable(logging.WARNING)
config = json.loads(sys.argv[2])
prefix = json.loads(sys.argv[3])
if ranks > 1:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120))
    world = dist.new_group(list(range(ranks)))
    pair = dist.new_group(list(range(ranks)))
    singles = [dist.new_group([r]) for r in range(ranks)]
    config.update(tp_size=ranks, tp_cpu_group=world, attn_tp_cpu_group=pair, attn_cp_cpu_group=singles[rank])
# The scheduler's all-reduces during timed rounds, counted: the agreement's cost in collectives.
collectives = [0]
real_all_reduce = dist.all_reduce if ranks > 1 else None
def counting_all_reduce(*args, **kwargs):
    collectives[0] += 1
    return real_all_reduce(*args, **kwargs)
if ranks > 1:
    dist.all_reduce = counting_all_reduce
placebo = config.pop("placebo", False)
untimed_vote = config.pop("untimed_vote", False)
# Tokens each rank holds mapped before every round (an elastic pool's decode credit: what no
# co-tenant can take), so that the patched decode step runs on the credit its prefill agreed.
mapped = config.pop("mapped", 0)
harness = sh.build_harness(**config)
if placebo:
    # Pristine with one all-reduce exactly where the patched scheduler votes: right after the
    # batch's allocation (alloc_for_extend in prepare_for_extend, alloc_for_decode in
    # prepare_for_decode), before the rest of the batch is prepared. What any collective at that
    # point of a round costs, the ranks' skew included.
    import torch
    import sglang.srt.managers.schedule_batch as schedule_batch
    def with_all_reduce_after(function, size):
        original = getattr(schedule_batch, function)
        def allocate_then_all_reduce(*args, **kwargs):
            result = original(*args, **kwargs)
            counting_all_reduce(torch.zeros(size, dtype=torch.int64), op=dist.ReduceOp.MAX, group=pair)
            return result
        setattr(schedule_batch, function, allocate_then_all_reduce)
    with_all_reduce_after("alloc_for_extend", 8)
    with_all_reduce_after("alloc_for_decode", 3)
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("allreduce"):
        # One bare all-reduce of a few integers between the same ranks: the unit of cost.
        import torch
        vote = torch.zeros(4, dtype=torch.int64)
        times = []
        for _ in range(int(line.split()[1])):
            dist.barrier(group=world)
            start = time.perf_counter()
            real_all_reduce(vote, op=dist.ReduceOp.MAX, group=pair)
            times.append(time.perf_counter() - start)
        print(json.dumps({"times": times, "collectives": 0}), flush=True)
        continue
    decode = line.startswith("decode")
    rounds = int(line.split()[-1])
    times = []
    timed_collectives = 0  # made inside the timed part of each round only
    scheduler = harness.scheduler
    scheduler.enable_skip_finishing_decode = False
    scheduler.decode_offload_manager = None
    for _ in range(rounds):
        harness.reset()
        if mapped:
            harness.physical.hold_mapped(mapped)
        if harness.cfg.hicache:
            harness.put_prefix_on_host(prefix)
            harness.add_request(prefix + [1, 2, 3])
        for i in range(3):
            harness.add_request(list(range(10 + 50 * i, 30 + 50 * i)))
        if decode:
            # The timed step decodes the batch this untimed prefill made.
            batch = harness.run_round()
            for req in batch.reqs:
                req.output_ids.append(7)
            harness.prepare_next_round()
            scheduler.running_batch = batch
        if untimed_vote:
            import torch
            real_all_reduce(torch.zeros(8, dtype=torch.int64), op=dist.ReduceOp.MAX, group=pair)
        if ranks > 1:
            dist.barrier(group=world)  # the ranks start each timed round together
        collectives_before = collectives[0]
        start = time.perf_counter()
        if decode:
            stepped = scheduler.update_running_batch(batch)
        else:
            batch = harness.run_round()
        times.append(time.perf_counter() - start)
        timed_collectives += collectives[0] - collectives_before
        assert batch is not None and len(batch.reqs) >= 3, "the benchmark batch must allocate"
        if decode:
            assert stepped is batch and len(batch.out_cache_loc) == len(batch.reqs), "the step must allocate"
    print(json.dumps({"times": times, "collectives": timed_collectives}), flush=True)
"""


def worktree(tree: str, ref: str) -> Path:
    checkout = Git(ROOT / "upstream" / "sglang")
    return checkout.fresh_worktree(ROOT / "build" / "bench" / tree, ref) / "python"


Ranks = list[subprocess.Popen[str]]


def start_worker(tree: Path, config: dict[str, object], ranks: int, store: Path) -> Ranks:
    """One process per rank of one tree; all ranks are started before any is waited for."""
    env = {**os.environ, "CARRY_TREE_SGLANG": str(tree), "PYTHONPATH": str(tree)}
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-c", WORKER, str(HARNESS_DIR)),
                *(json.dumps(config), json.dumps(HOST_PREFIX), str(rank), str(ranks), str(store)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(ranks)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return procs


class Block(NamedTuple):
    times: list[float]  # per round, its slowest rank's
    collectives: int  # the all-reduces rank 0 made in the block's rounds


def run_block(procs: Ranks, rounds: int, command: str = "") -> Block:
    """Every rank runs the block; a round takes as long as its slowest rank."""
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{command}{rounds}\n")
        proc.stdin.flush()
    per_rank = [json.loads(proc.stdout.readline()) for proc in procs if proc.stdout is not None]
    times = [max(each) for each in zip(*(rank["times"] for rank in per_rank), strict=True)]
    return Block(times, per_rank[0]["collectives"])


def plain_pool_limit(floor: float) -> float:
    """What the plain pools' patched/pristine ratio is judged against, by what the run can decide:
    two processes of the same code read up to a few percent apart here (their memory layout), as
    much as the target, and the run measures that distance itself (its floor). So the ratio fails
    only where it is past the target by more than that distance."""
    return PLAIN_TARGET + abs(floor - 1)


def plain_pool_failures(ratio: float, floor: float) -> list[str]:
    limit = plain_pool_limit(floor)
    if ratio <= limit:
        return []
    return [
        f"plain pools: ratio {ratio:.4f} > {limit:.4f} ({PLAIN_TARGET} + the floor's {abs(floor - 1):.4f})"
    ]


def floor_too_far(floor: float) -> bool:
    """A run whose two pristine processes read this far apart judges nothing (exit 2)."""
    return abs(floor - 1) > FLOOR_LIMIT


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", help="the sglang line (default: the default line, as `carry` picks it)")
    parser.add_argument("--rounds", type=int, default=4000, help="timed rounds per tree")
    parser.add_argument("--block", type=int, default=25, help="rounds per alternating block")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--config", choices=sorted(CONFIGS), help="the pools (default: mamba; page1 with --phase decode)"
    )
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    parser.add_argument(
        "--phase", choices=("prefill", "decode"), default="prefill", help="what one timed round is"
    )
    parser.add_argument(
        "--before", metavar="REF", help="also time this commit of upstream/sglang (an earlier series)"
    )
    parser.add_argument(
        "--patched",
        metavar="REF",
        help="time this commit of upstream/sglang as the patched tree (default: carry/<version>)",
    )
    args = parser.parse_args()
    if args.version is None:
        args.version = default_target(Project(ROOT), Project(ROOT).pins()["sglang"]).version
    if args.config is None:
        args.config = "page1" if args.phase == "decode" else "mamba"
    if args.phase == "decode" and CONFIGS[args.config].get("ping_pong"):
        parser.error(f"--config {args.config}: a ping-pong decode step pins host memory, which needs CUDA")

    trees = {
        "pristine": worktree("pristine", f"upstream/{args.version}"),
        "patched": worktree("patched", args.patched or f"carry/{args.version}"),
    }
    if args.before:
        trees["before"] = worktree("before", args.before)
    pools: dict[str, dict[str, object]] = (
        {"plain": {}} if args.ranks == 1 else {"plain": {}, "elastic": {"elastic": True}}
    )
    cases = [(tree, pool) for pool in pools for tree in trees]
    # The pristine tree in a second process: two processes of the same code differ by up to a few
    # percent (their memory layout), as much as the target, so pristine's median is taken over
    # both, and their ratio is printed as the run's own floor.
    trees[AGAIN] = trees["pristine"]
    cases.append((AGAIN, "plain"))
    if args.ranks > 1:
        pools["placebo"] = PLACEBO
        cases.append(("pristine", "placebo"))
    if args.ranks > 1 and args.phase == "decode":
        pools["credited"] = CREDITED
        cases += [("pristine", "credited"), ("patched", "credited")]
    print(f"bench: starting {args.ranks} worker(s) per case ({args.config}); importing sglang takes a while")
    stores = ROOT / "build" / "bench" / "stores"
    stores.mkdir(parents=True, exist_ok=True)
    workers: dict[tuple[str, str], Ranks] = {}
    bare: list[float] = []
    try:
        for tree, pool in cases:
            store = stores / f"{tree}-{pool}-{os.getpid()}"
            store.unlink(missing_ok=True)
            config = {**CONFIGS[args.config], **pools[pool], **PER_CASE.get((tree, pool), {})}
            workers[tree, pool] = start_worker(trees[tree], config, args.ranks, store)
        phase = "decode " if args.phase == "decode" else ""
        for procs in workers.values():
            run_block(procs, args.warmup, command=phase)
        samples: dict[tuple[str, str], list[float]] = {case: [] for case in workers}
        collectives = dict.fromkeys(workers, 0)
        started = time.monotonic()
        order = list(workers)
        while len(samples["patched", "plain"]) < args.rounds:
            for case in order:
                block = run_block(workers[case], args.block, command=phase)
                samples[case].extend(block.times)
                collectives[case] += block.collectives
            # Rotated, so every case takes every place in the cycle equally often.
            order = order[1:] + order[:1]
            done = len(samples["patched", "plain"])
            if done % 1000 == 0:
                elapsed = time.monotonic() - started
                print(f"bench: {done}/{args.rounds} rounds per case ({elapsed:.0f} s)", flush=True)
        if args.ranks > 1:
            bare = run_block(workers["patched", "plain"], args.rounds, command="allreduce ").times
    finally:
        for procs in workers.values():
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=60)
    medians = {case: statistics.median(times) for case, times in samples.items()}
    per_round = {case: collectives[case] / len(times) for case, times in samples.items()}
    floor = medians[AGAIN, "plain"] / medians["pristine", "plain"]
    pristine_plain = statistics.median(samples["pristine", "plain"] + samples[AGAIN, "plain"])
    for (tree, pool), median in medians.items():
        label = f"{args.ranks} rank(s) {args.phase} {pool:8s} {tree:14s}"
        print(
            f"{label} median {median * 1e3:.4f} ms over {args.rounds} rounds, "
            f"{per_round[tree, pool]:.2f} all-reduce(s) per round"
        )
    print(
        f"{args.ranks} rank(s) {args.phase}, plain pools: pristine/pristine in two processes "
        f"{floor:.4f} (the same code: this run's floor)"
    )
    if "before" in trees:
        print(
            f"{args.ranks} rank(s) {args.phase}, plain pools: patched/before median ratio "
            f"{medians['patched', 'plain'] / medians['before', 'plain']:.4f}"
        )
    ratio = medians["patched", "plain"] / pristine_plain
    print(
        f"{args.ranks} rank(s) {args.phase}, plain pools: patched/pristine median ratio {ratio:.4f} "
        f"(target <= {PLAIN_TARGET}; pristine over both its processes)"
    )
    if "elastic" in pools:
        for tree in [t for t in trees if t not in ("pristine", AGAIN)]:
            cost = medians[tree, "elastic"] - medians["pristine", "elastic"]
            print(
                f"{args.ranks} rank(s) {args.phase}, elastic pool: {tree}/pristine median ratio "
                f"{medians[tree, 'elastic'] / medians['pristine', 'elastic']:.4f}, "
                f"the agreement costs {cost * 1e6:.0f} us per round"
            )
    if bare:
        print(
            f"{args.ranks} rank(s): one bare gloo all-reduce of 4 integers, "
            f"median {statistics.median(bare) * 1e6:.0f} us"
        )
    # Timed verdicts (judged only where the floor lets the run tell them) and counted ones (exact).
    timed = plain_pool_failures(ratio, floor)
    counted: list[str] = []
    print(
        f"{args.ranks} rank(s) {args.phase}, plain pools: judged at <= {plain_pool_limit(floor):.4f}"
        f" (the target plus this run's floor's distance from 1, {abs(floor - 1):.4f})"
    )
    if "elastic" in pools:
        placebo_cost = medians["pristine", "placebo"] - medians["pristine", "elastic"]
        cost = medians["patched", "elastic"] - medians["pristine", "elastic"]
        agreements = per_round["patched", "elastic"]
        print(
            f"{args.ranks} rank(s) {args.phase}: one all-reduce where the vote is (after the allocation)"
            f" costs the pristine round {placebo_cost * 1e6:.0f} us; the agreement costs"
            f" {cost / placebo_cost:.2f} of it (target <= {AGREEMENT_TARGET}), in"
            f" {agreements:.2f} all-reduce(s) per round (target <= 1)"
        )
        if cost > AGREEMENT_TARGET * placebo_cost:
            timed.append(f"elastic pool: the agreement costs {cost / placebo_cost:.2f} all-reduces")
        if agreements > 1:
            counted.append(f"elastic pool: {agreements:.2f} all-reduces per round")
    if "credited" in pools:
        credited = per_round["patched", "credited"]
        print(
            f"{args.ranks} rank(s) decode, elastic pool on the decode credit: patched/pristine (one untimed"
            " all-reduce before each step, as patched's prefill votes) median"
            f" ratio {medians['patched', 'credited'] / medians['pristine', 'credited']:.4f}, in"
            f" {credited:.2f} all-reduce(s) per step (target 0)"
        )
        if credited > 0:
            counted.append(f"credited decode steps: {credited:.2f} all-reduces per step")
    return verdict(floor, timed, counted)


def verdict(floor: float, timed: list[str], counted: list[str]) -> int:
    """Print what missed its target; the exit status. A run whose floor is too far from 1 judges
    only what it counts (exit 2 when that holds: run it again)."""
    too_far = floor_too_far(floor)
    judged = counted if too_far else [*counted, *timed]
    for failure in judged:
        print(f"bench: over target: {failure}")
    if too_far:
        print(
            f"bench: error: pristine/pristine read {floor:.4f}, more than {FLOOR_LIMIT:.0%} from 1, so the"
            " timed targets were not judged: run it again on an idle machine",
            file=sys.stderr,
        )
        return 1 if judged else 2
    return 1 if judged else 0


if __name__ == "__main__":
    sys.exit(main())
