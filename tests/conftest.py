"""Shared test setup: put the tool on the path and, for upstream tests, the upstream trees."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

# --------------------------------------------------------------------------------------------
# Tests marked `gpu` (tests/gpu/): skipped with the reason where no CUDA device can be used, so
# CPU runs stay green; a run that asks for a GPU (CARRY_REQUIRE_GPU=1, as the nightly's GPU step
# and ci/gpu-bare set it) FAILS them instead, so a runner with a CPU-only torch or no driver can
# never pass the GPU step by skipping it.
# --------------------------------------------------------------------------------------------
REQUIRE_GPU_ENV = "CARRY_REQUIRE_GPU"


def gpu_unavailable_reason() -> str | None:
    """Why this process cannot run the GPU tests, or None when it can."""
    try:
        import torch
    except ImportError as error:
        return f"needs a CUDA device: torch does not import ({error})"
    if torch.version.cuda is None:
        return f"needs a CUDA device: torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"needs a CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"
    return None


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    if gpu_required():
        pytest.fail(f"{reason}, and {REQUIRE_GPU_ENV}=1 asks for one", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_GPU_ENV}=1 to fail instead)")
