"""GPU tests: the real patched sglang modules (the same trees as tests/upstream/, through
CARRY_TREE_SGLANG) with real CUDA streams, events and host->device copies.

Every test here is marked `gpu`: tests/conftest.py skips it with the reason where no CUDA device
can be used and fails it when CARRY_REQUIRE_GPU=1. Measurements are collected in `RESULTS`,
printed as a short table at the end of the run and, with CARRY_GPU_RESULTS=<file>, written there
as JSON (ci/nightly and ci/gpu-bare keep it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# The upstream trees on sys.path (and their own TORCH_EXTENSIONS_DIR), as for tests/upstream/.
import upstream.conftest  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "upstream" / "sglang"))

if TYPE_CHECKING:  # mypy names this folder's modules from tests/, as the package `gpu`
    from gpu.gpu_results import RESULTS, format_table
else:  # pytest puts tests/gpu itself on sys.path
    from gpu_results import RESULTS, format_table


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    terminalreporter.section("GPU measurements")
    for line in format_table(RESULTS):
        terminalreporter.write_line(line)
    target = os.environ.get("CARRY_GPU_RESULTS")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(RESULTS, indent=2, sort_keys=True) + "\n")
