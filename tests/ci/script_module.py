"""Import a CI script (a file run by path, not a package module) for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(module_name: str, path: Path) -> ModuleType:
    """The script at ``path`` imported as ``module_name`` (registered in sys.modules first, so its
    dataclasses and pickles resolve their module)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, f"{path} is not a Python file"
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
