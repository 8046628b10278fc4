from __future__ import annotations

import scheduler_harness as sh
from event_loop_driver import EventLoopDriver
from test_prefill_unwind import _prompt


def test_single_rank_requests_finish() -> None:
    with sh.build_harness(enable_overlap=False) as h:
        d = EventLoopDriver(h)
        reqs = [h.make_req(_prompt(i, n), max_new_tokens=4) for i, n in enumerate([5, 17, 40])]
        for r in reqs:
            h.scheduler._add_request_to_queue(r)
        its = d.run_until_idle(max_iterations=50)
        print(its)
        print(d.installed)
        assert all(r.finished() for r in reqs)
        assert h.idle_leak_report() == []
