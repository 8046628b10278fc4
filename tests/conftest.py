"""Shared test setup: put the tool on the path and, for upstream tests, the upstream trees."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
