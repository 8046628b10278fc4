"""The forked-rank runner the two-rank tests share: a failed rank ends the run for every rank."""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import forked_ranks
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 120.0
# Longer than the run may take: a peer still stuck when the run returns was killed.
STUCK_S = 600.0


def _rank_0_fails_rank_1_is_stuck(rank: int) -> str:
    if rank == 0:
        raise RuntimeError("rank 0 gives up")
    # Stuck where gloo does not see the peer go (a thread blocked in a collective while the
    # main thread waits on its result, say), so nothing but the runner can end it.
    time.sleep(STUCK_S)
    return "rank 1 woke up"


def test_a_failed_rank_stops_its_peers() -> None:
    results, errors = forked_ranks.run_forked_ranks(
        _rank_0_fails_rank_1_is_stuck,
        ranks=2,
        timeout_s=RUN_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    assert results == {}
    assert len(errors) == 2, errors
    assert errors[0].startswith("rank 0:") and "RuntimeError: rank 0 gives up" in errors[0]
    # Not "hung: no result within 120 s": the runner did not wait for the stuck peer.
    assert errors[1].startswith("rank(s) [1] killed: no result"), errors[1]


def _rank_1_makes_a_folder_and_is_stuck(rank: int, made: Path) -> None:
    if rank == 1:
        made.write_text(tempfile.mkdtemp(prefix="rank-scratch-"))
        time.sleep(STUCK_S)
    for _ in range(600):  # until rank 1 has made it (at most 60 s)
        if made.exists():
            break
        time.sleep(0.1)
    raise RuntimeError("rank 0 gives up")


def test_what_a_killed_rank_made_in_a_temporary_folder_is_removed(tmp_path: Path) -> None:
    """A rank killed runs no cleanup: a harness's model folder was left in /tmp by every such run."""
    made = tmp_path / "made"
    _, errors = forked_ranks.run_forked_ranks(
        functools.partial(_rank_1_makes_a_folder_and_is_stuck, made=made),
        ranks=2,
        timeout_s=RUN_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    assert errors[-1].startswith("rank(s) [1] killed: no result"), errors
    folder = Path(made.read_text())
    assert folder.name.startswith("rank-scratch-") and not folder.exists()


def _both_return(rank: int) -> int:
    dist.barrier()
    return rank * 10


def test_ranks_that_succeed_report_their_results() -> None:
    results, errors = forked_ranks.run_forked_ranks(
        _both_return, ranks=2, timeout_s=RUN_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )
    assert errors == []
    assert results == {0: 0, 1: 10}
