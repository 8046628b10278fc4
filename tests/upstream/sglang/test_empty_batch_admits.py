"""An empty running batch does not keep admission shut (series entry "Scheduler: an empty running
batch does not keep admission shut", 0.5.20 and 0.5.21; upstream has it from 0.5.22 on).

A round that finds no room marks the running batch full; with nothing running, no decode step or
merge comes to clear the mark, and every later round returned before admitting anything: the
waiting requests were never scheduled, even once memory was free again. Reached with a pool whose
free space is per rank when a co-tenant holds memory after a decode miss retracted every request
(test_event_loop_driver.py drives it through the real loop).

Expected: FAILS on 0.5.20 and 0.5.21 without the entry (the request is never admitted), PASSES
with it and on 0.5.22 on.
"""

from __future__ import annotations

import scheduler_harness as sh
from test_prefill_unwind import _prompt


def test_a_request_waiting_behind_an_empty_running_batch_marked_full_is_admitted() -> None:
    with sh.build_harness() as h:
        sched = h.scheduler
        assert sched.running_batch.is_empty()
        sched.running_batch.batch_is_full = True  # what a round that found no room left
        req = h.add_request(_prompt(0, 40))
        batch = h.run_round()
        assert batch is not None and batch.reqs == [req]
