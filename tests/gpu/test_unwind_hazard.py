"""The hazard the unwind's wait (series entry 0002) closes, on a real GPU, and what the wait costs.

See unwind_trials.py for one trial. "Without the wait" is the full series with
`Scheduler._wait_for_batch_host_load` monkeypatched to a no-op in the test (the same as building
the tree without entry 0002, whose only other change is the docstring of the caller).

Hazard: with the full series no trial may be torn (the guard). Without the wait the torn count is
measured and reported; it is expected to be high with a forward in flight (the load is fenced
behind it), but a device that happens to land every copy before the next owner's write would
report 0: the test then says so instead of failing, and the guard stays.

Cost: the unwind's event wait against `torch.cuda.synchronize()` in its place, host time of the
wait, median of many runs. `start_loading` makes the H2D stream wait on the forward stream, so with
only a forward in flight the two should be close; with other device work queued after the load
started (another stream) only the device-wide synchronize waits for it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import scheduler_harness as sh
from sglang.srt.managers.scheduler import Scheduler

if TYPE_CHECKING:  # mypy names this folder's modules from tests/, as the package `gpu`
    import gpu.unwind_trials as ut
    from gpu.gpu_results import RESULTS
else:  # pytest puts tests/gpu itself on sys.path
    import unwind_trials as ut
    from gpu_results import RESULTS

pytestmark = pytest.mark.gpu

TRIALS = int(os.environ.get("CARRY_GPU_HAZARD_TRIALS", "30"))
COST_RUNS = int(os.environ.get("CARRY_GPU_COST_RUNS", "30"))
FORWARD_MS = 20.0  # the forward kernel in flight
HAZARD_SCENARIOS = {"forward_in_flight": FORWARD_MS, "copy_only": 0.0}
COST_SCENARIOS = {"forward_in_flight": (FORWARD_MS, 0.0), "forward_and_other": (FORWARD_MS, 20.0)}


@pytest.fixture(scope="module")
def harness() -> Iterator[sh.Harness]:
    if not hasattr(Scheduler, "_wait_for_batch_host_load"):
        pytest.skip("this tree has no unwind wait (pristine, or without its series entry)")
    with sh.build_harness(**ut.GPU_HARNESS) as h:
        yield h


def _count(h: sh.Harness, forward_ms: float, wait: Any) -> dict[str, int]:
    trials = [ut.unwind_once(h, forward_ms, wait=wait) for _ in range(TRIALS)]
    return {
        "trials": len(trials),
        "torn": sum(t.torn_mamba or t.torn_kv for t in trials),
        "torn_mamba": sum(t.torn_mamba for t in trials),
        "torn_kv": sum(t.torn_kv for t in trials),
        "with_freed": sum(bool(t.freed_mamba or t.freed_kv) for t in trials),
    }


@pytest.mark.parametrize("scenario", HAZARD_SCENARIOS)
def test_hazard_torn_outcomes_with_and_without_the_wait(harness: sh.Harness, scenario: str) -> None:
    forward_ms = HAZARD_SCENARIOS[scenario]
    without = _count(harness, forward_ms, ut.no_wait)
    full = _count(harness, forward_ms, None)
    RESULTS.setdefault("hazard", {})[scenario] = {"without_wait": without, "full_series": full}

    assert full["with_freed"] > 0, "no trial freed a load target: the unwind released nothing"
    assert full["torn"] == 0, f"torn with the full series: {full}"
    if without["torn"] == 0:
        warnings.warn(
            f"{scenario}: the hazard was not reproduced without the wait (0/{without['trials']} torn)",
            stacklevel=1,
        )


@pytest.mark.parametrize("scenario", COST_SCENARIOS)
def test_cost_event_wait_against_device_synchronize(harness: sh.Harness, scenario: str) -> None:
    forward_ms, other_ms = COST_SCENARIOS[scenario]
    event, device = [], []
    for _ in range(COST_RUNS):  # interleaved, so drift hits both alike
        event.append(ut.unwind_once(harness, forward_ms, other_ms, wait=None).wait_seconds)
        device.append(ut.unwind_once(harness, forward_ms, other_ms, wait=ut.device_sync_wait).wait_seconds)
    result = {
        "runs": COST_RUNS,
        "event_wait_ms": ut.median_ms(event),
        "device_sync_ms": ut.median_ms(device),
        "forward_kernel_ms": ut.forward_kernel_ms(forward_ms),
        "other_stream_ms": other_ms,
    }
    RESULTS.setdefault("cost", {})[scenario] = result
    # The event wait covers the forward the load is fenced behind: it cannot be near zero.
    assert result["event_wait_ms"] > 0.25 * result["forward_kernel_ms"], result
