"""Measurements of the GPU tests, shared by the tests and conftest.py (which prints them)."""

from __future__ import annotations

from typing import Any

RESULTS: dict[str, Any] = {}


def format_table(results: dict[str, Any]) -> list[str]:
    """The short table: torn outcomes per variant, then the wait costs."""
    lines: list[str] = []
    for scenario, variants in sorted(results.get("hazard", {}).items()):
        for variant, r in sorted(variants.items()):
            lines.append(
                f"hazard  {scenario:<18} {variant:<12} torn {r['torn']:>3}/{r['trials']:<3}"
                f" (mamba {r['torn_mamba']}, kv {r['torn_kv']}; freed targets seen in {r['with_freed']})"
            )
    for scenario, r in sorted(results.get("cost", {}).items()):
        lines.append(
            f"cost    {scenario:<18} event wait {r['event_wait_ms']:7.3f} ms   device sync"
            f" {r['device_sync_ms']:7.3f} ms   forward kernel {r['forward_kernel_ms']:7.3f} ms"
            f"  (median of {r['runs']})"
        )
    return lines
