"""Tests of the carried fixes import the REAL upstream packages from a tree on disk.

`carry verify` points CARRY_TREE_<NAME> at a worktree of the commit under test (pristine, or with
some patches); otherwise the tree is the checkout's carry branch, upstream/<name>/<subdir>.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = {"sglang": "upstream/sglang/python", "kvcached": "upstream/kvcached"}


def upstream_tree(name: str) -> Path:
    return Path(os.environ.get(f"CARRY_TREE_{name.upper()}", ROOT / TREES[name])).resolve()


for _name in TREES:
    _tree = upstream_tree(_name)
    if not _tree.is_dir():
        raise pytest.UsageError(
            f"no {_name} tree at {_tree}: run `./scripts/carry fetch && ./scripts/carry apply` first"
        )
    sys.path.insert(0, str(_tree))

# torch compiles JIT extensions (sglang's HiCache native hash) into ~/.cache/torch_extensions by
# default: one folder for every tree and process, where concurrent runs on different trees rebuild
# the extension over each other. Each tree gets its own folder under build/ instead; `carry verify`
# sets one per tree itself.
_trees_key = hashlib.sha256("\0".join(str(upstream_tree(n)) for n in TREES).encode()).hexdigest()[:16]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions" / _trees_key))
