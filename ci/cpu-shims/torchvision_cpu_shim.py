"""Let PyPI's torchvision 0.28.0 (a CUDA build) import beside the CPU-only torch 2.13.0.

Only for the CPU test environment: scripts/test_env.py copies this module into .venv-test's
site-packages and loads it from a .pth file. sglang 0.5.20 imports torchvision.io
unconditionally (srt/utils/common.py:98); torchvision's _C.so needs libtorch_cuda, so its ops do
not load, which torchvision tolerates except in _meta_registrations.py, whose
register_fake("torchvision::nms") fails with "operator torchvision::nms does not exist".

Before torchvision._meta_registrations runs, define the schemas of
torchvision::nms and torchvision::qnms when torchvision's _C extension could not
be loaded (it registers them otherwise). No kernels are registered: calling the
ops raises torchvision's own "Couldn't load custom C++ ops" error.
"""

import contextlib
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_TARGET = "torchvision._meta_registrations"
_LIB: object = None  # keep the torch.library.Library alive


def _define_missing_ops() -> None:
    global _LIB
    ext = sys.modules.get("torchvision.extension")
    if ext is None or ext._has_ops():
        return
    import torch

    lib = None
    for op in ("nms", "qnms"):
        if hasattr(torch.ops.torchvision, op):
            continue
        # torch.library.Library's __init__ and define are unannotated.
        if lib is None:
            lib = torch.library.Library("torchvision", "FRAGMENT")  # type: ignore[no-untyped-call]
        lib.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[no-untyped-call]
    _LIB = lib


class _TorchvisionCpuShim:
    @classmethod
    def find_spec(
        cls, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == _TARGET:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(cls)
            try:
                _define_missing_ops()
            except Exception as e:  # never break the import itself
                print(f"torchvision_cpu_shim: {e!r}", file=sys.stderr)
        return None


if _TorchvisionCpuShim not in sys.meta_path:
    sys.meta_path.insert(0, _TorchvisionCpuShim)
