"""Run a function on forked gloo ranks, on CPU, and collect what each rank returned.

Fork (not spawn) so the ranks reuse the sglang modules this process imported: a spawned child
would re-import them for 10-30 s. Nothing distributed may be initialized in this process.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import queue
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch
import torch.distributed as dist

# How long the other ranks may still report once one rank has failed.
PEER_GRACE_S = 2.0


class RankResults(NamedTuple):
    results: dict[int, Any]  # rank -> what the body returned
    errors: list[str]  # a rank's traceback, or the ranks that hung


class ConsensusVerdict(NamedTuple):
    """What upstream's rank-consensus checker found on this rank: the message it logs where the
    ranks' recorded decisions differed (it then ends the process; here the block ends instead)."""

    divergences: list[str]


@contextlib.contextmanager
def rank_consensus_checked(groups: list[Any]) -> Iterator[ConsensusVerdict]:
    """Upstream's own rank-consensus checker (utils/rank_consensus_checker.py) over `groups` for
    the block, on every rank of the world alike: every `@rank_consensus` call of the radix cache
    and the SWA allocator is compared across the ranks by its background gloo groups, and flushed
    when the block ends. Its decorators exist only where SGLANG_ENABLE_RANK_CONSENSUS_CHECKER was
    set before sglang was imported (tests/upstream/conftest.py does). Upstream ends the process
    on a divergence (os._exit from its thread); here it is recorded in the verdict and its thread
    ends, so the test decides: none where the ranks must agree, one where the divergence is the
    scenario's own."""
    from sglang.srt.utils import rank_consensus_checker as checker

    verdict = ConsensusVerdict([])

    def end_thread(status: int) -> None:
        raise SystemExit(status)

    with (
        mock.patch.object(checker.logger, "critical", verdict.divergences.append),
        mock.patch.object(checker, "os", types.SimpleNamespace(_exit=end_thread)),
    ):
        checker.configure([types.SimpleNamespace(cpu_group=group) for group in groups])
        try:
            yield verdict
        finally:
            checker.shutdown()


def _rank_main(
    rank: int, ranks: int, store: str, collective_timeout_s: float, body: Callable[[int], Any], results: Any
) -> None:
    # A rank killed (hung, or stuck after its peer failed) runs no cleanup, and a harness's model
    # folder outlived every such run in the system's temporary folder: a rank's temporary files go
    # inside the run's own folder, which the parent removes.
    tempfile.tempdir = str(Path(store).parent)
    try:
        # The parent's OpenMP pool does not survive the fork: a parallel torch op in the child
        # (sglang 0.5.23 zero-fills its KV buffers with one large torch.zeros per layer) would
        # wait forever for its workers. The ranks run their ops inline instead.
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=ranks,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        out = body(rank)
        dist.destroy_process_group()
        results.put((rank, out, None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        # Flush the queue's feeder thread, then leave without running the parent's pytest
        # teardown or atexit hooks, which a forked child inherited.
        results.close()
        results.join_thread()
        os._exit(0)


def run_forked_ranks(
    body: Callable[[int], Any], *, ranks: int, timeout_s: float, collective_timeout_s: float
) -> RankResults:
    """Run ``body(rank)`` on `ranks` forked processes of one gloo world, all within `timeout_s`
    (a rank that has not answered by then is reported as hung and killed). Once one rank has
    failed, the others have `PEER_GRACE_S` left to answer before they are killed."""
    assert not dist.is_initialized(), "fork the ranks from a process without a process group"
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    out = RankResults({}, [])
    with tempfile.TemporaryDirectory(prefix="forked-ranks-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [
            ctx.Process(target=_rank_main, args=(rank, ranks, store, collective_timeout_s, body, results))
            for rank in range(ranks)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        reported: set[int] = set()
        try:
            for _ in range(ranks):
                rank, result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
                reported.add(rank)
                if error is not None:
                    out.errors.append(f"rank {rank}:\n{error}")
                    # The run has failed; its peers are most likely blocked in a collective
                    # with the failed rank and would only report its timeout.
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                else:
                    out.results[rank] = result
        except queue.Empty:
            missing = sorted(set(range(ranks)) - reported)
            if out.errors:
                out.errors.append(f"rank(s) {missing} killed: no result {PEER_GRACE_S} s after a rank failed")
            else:
                out.errors.append(f"rank(s) {missing} hung: no result within {timeout_s} s")
        finally:
            for rank, proc in enumerate(procs):
                # A rank that reported is on its way out; one that did not is hung or blocked.
                proc.join(timeout=10 if rank in reported else 0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return out
