"""How long a step took, for the one line each long step prints when it ends."""

from __future__ import annotations

import time


class Stopwatch:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __str__(self) -> str:
        return f"{time.monotonic() - self.started:.1f} s"


def megabytes(size: int) -> str:
    return f"{size / 1_000_000:.1f} MB"
