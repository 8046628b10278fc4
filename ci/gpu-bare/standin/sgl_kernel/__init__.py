"""A stand-in for sgl_kernel (the sglang-kernel wheel: CUDA kernels, far over the 64 MiB a bare
GPU machine gets), used by ci/gpu-bare/run only where the real one does not import.

Every name and submodule is a placeholder that raises when called (carry_standin), except the
HiCache "direct" copies of `sgl_kernel.kvcacheio`, which the GPU tests do run: torch indexing
copies here (kvcacheio.py), as the harness swaps the paged allocator's Triton kernel for
upstream's own torch port on CPU.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from carry_standin import Placeholder, PlaceholderFinder

CARRY_STANDIN = True
__version__ = "0.0.0+carry.standin"


def __getattr__(name: str) -> Any:
    if name == "kvcacheio":  # the one real submodule (a module __getattr__ is asked before imports)
        return importlib.import_module(f"{__name__}.kvcacheio")
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder(f"sgl_kernel.{name}")


sys.meta_path.append(PlaceholderFinder(("sgl_kernel",), real=("sgl_kernel", "sgl_kernel.kvcacheio")))
