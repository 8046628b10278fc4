"""Tests of the carried fixes import the REAL upstream packages from a tree on disk.

`carry verify` points CARRY_TREE_<NAME> at a worktree of the commit under test (pristine, or with
some patches); otherwise the tree is the checkout's carry branch, upstream/<name>/<subdir>.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from sglang_carry.project import Project
from sglang_carry.verify import tree_env_var

ROOT = Path(__file__).resolve().parents[2]
# Each pinned package's tree: its checkout and the folder the package's code is in (the pins say).
PROJECT = Project(ROOT)
TREES = {name: PROJECT.checkout(name) / upstream.source_subdir for name, upstream in PROJECT.pins().items()}


def upstream_tree(name: str) -> Path:
    return Path(os.environ.get(tree_env_var(name), TREES[name])).resolve()


for _name in TREES:
    _tree = upstream_tree(_name)
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
