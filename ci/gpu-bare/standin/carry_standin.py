"""Placeholder packages for CUDA-only libraries the bare GPU machine lacks (see sgl_kernel/).

On a CUDA machine sglang imports sgl_kernel, flashinfer and a few more at module level all along
the scheduler's import chain; the GPU tests call none of them (only sgl_kernel.kvcacheio's direct
copies, which sgl_kernel/kvcacheio.py implements with torch). `install()` (run by this folder's
sitecustomize.py) makes each name in STANDIN_PACKAGES that does not import on its own a package
whose every attribute and submodule is a placeholder that raises when called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

STANDIN_PACKAGES = ("flashinfer", "sgl_deep_gemm", "deep_gemm", "deep_ep", "flash_attn", "quack", "cutlass")


class Placeholder:
    """A kernel (or a namespace of kernels) that is not here: raises when called."""

    def __init__(self, qualified: str) -> None:
        self._qualified = qualified
        self.__name__ = qualified.rsplit(".", 1)[-1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._qualified}: not on this machine (a carry-gpu-bare stand-in)")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._qualified}.{name}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(placeholder.Base)` still defines a class


class PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self.__name__}.{name}")


class PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `top` and `top.<anything>` to placeholder modules, except the names in `real`."""

    def __init__(self, tops: tuple[str, ...], real: tuple[str, ...] = ()) -> None:
        self.tops, self.real = tops, real

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in self.real or name.split(".")[0] not in self.tops:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = PlaceholderModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+carry.standin"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> list[str]:
    """Stand in for each STANDIN_PACKAGES (plus CARRY_STANDIN_EXTRA) name that is missing."""
    names = [*STANDIN_PACKAGES, *filter(None, os.environ.get("CARRY_STANDIN_EXTRA", "").split(","))]
    missing = tuple(n for n in names if importlib.machinery.PathFinder.find_spec(n) is None)
    if missing:
        sys.meta_path.append(PlaceholderFinder(missing))
    return list(missing)
