"""Tests of the carried fixes import the REAL upstream packages from a tree on disk.

`carry verify` and the line tests point CARRY_TREE_<NAME> at a worktree of the commit under test
(pristine, or with some patches); otherwise the tree is the default line's carry branch, whatever
branch upstream/<name> is on (sglang_carry/trees.py).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from sglang_carry.errors import CarryError
from sglang_carry.project import Project
from sglang_carry.trees import default_tree, tree_env_var

# An allocation from a rank-local pool that no vote of the ranks' agreement covers fails the test
# that makes it (a server counts and logs it): a new unagreed path is found the first time it runs.
os.environ.setdefault("SGLANG_RANK_AGREEMENT_STRICT", "1")
# Upstream's rank-consensus checker: its decorators are made at import, so before sglang is imported;
# it compares nothing until a two-rank test configures it (forked_ranks.rank_consensus_checked).
os.environ.setdefault("SGLANG_ENABLE_RANK_CONSENSUS_CHECKER", "1")

ROOT = Path(__file__).resolve().parents[2]
PROJECT = Project(ROOT)
NAMES = sorted(PROJECT.pins())


def _named_tree(name: str) -> Path:
    named = os.environ.get(tree_env_var(name))
    if named:
        return Path(named).resolve()
    try:
        return default_tree(PROJECT, name).folder.resolve()
    except CarryError as error:
        raise pytest.UsageError(f"no {name} tree to test: {error}") from None


# Resolved once per run: a worktree is refreshed at most once, and every test sees the same tree.
TREES = {name: _named_tree(name) for name in NAMES}


def upstream_tree(name: str) -> Path:
    return TREES[name]


for _name, _tree in TREES.items():
    if not _tree.is_dir():
        raise pytest.UsageError(
            f"no {_name} tree at {_tree}: run `./scripts/carry fetch && ./scripts/carry apply` first"
        )
    sys.path.insert(0, str(_tree))

# Each tree set and torch gets its own extension folder, and every build a lock that dies with its
# builder (extension_builds.py); `carry verify` gives each tree a folder of its own, which this
# nests in as it nests in a user's TORCH_EXTENSIONS_DIR.
sys.path.insert(0, str(Path(__file__).resolve().parent))
extension_builds = importlib.import_module("extension_builds")
extension_builds.install([upstream_tree(n) for n in TREES])


# Lines a test leaves for the end of the run's output (the simulation's summary): pytest captures
# what a test prints, and `./scripts/test -q` shows only the failures.
SUMMARY_LINES = pytest.StashKey[list[str]]()


@pytest.fixture
def summary_lines(request: pytest.FixtureRequest) -> list[str]:
    """Lines this test leaves for the end of the run's output."""
    return request.config.stash.setdefault(SUMMARY_LINES, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in terminalreporter.config.stash.get(SUMMARY_LINES, []):
        terminalreporter.write_line(line)
