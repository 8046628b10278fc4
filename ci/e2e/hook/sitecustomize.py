"""Miss injection for the end-to-end test, loaded by every Python process of the server.

ci/e2e/run_e2e.py puts this folder on PYTHONPATH; Python imports `sitecustomize` at start-up in
the server and in every scheduler process it spawns. Nothing happens unless CARRY_E2E_INJECT=1.

With it, a KV allocation misses exactly as an elastic pool reports one (kvcached: the allocator's
`alloc` / `alloc_extend` returns None, nothing taken), and only where the carried unwind matters:
inside `ScheduleBatch.prepare_for_extend` of a batch whose HiCache load already started
(`hicache_consumer_index >= 0`, set by the scheduler just before). At most CARRY_E2E_MISS_LIMIT
misses (default 3) are injected, each on the first allocation of such a batch.

Counters (eligible allocations, injected misses, loads started) go to
CARRY_E2E_COUNTERS_DIR/<pid>.json, rewritten on every change, so they survive a killed server.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

BATCH_MODULE = "sglang.srt.managers.schedule_batch"
ALLOCATOR_PACKAGE = "sglang.srt.mem_cache.allocator"
CONTROLLER_MODULE = "sglang.srt.managers.cache_controller"
ALLOC_METHODS = ("alloc", "alloc_extend")


class Injector:
    """The miss decision and its counters; one per process."""

    def __init__(self, limit: int, counters_dir: Path | None) -> None:
        self.limit = limit
        self.counters_dir = counters_dir
        self.counts = {"eligible_allocations": 0, "injected_misses": 0, "loads_started": 0}
        self._local = threading.local()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def preparing(self, batch: Any) -> Iterator[None]:
        """Around prepare_for_extend: allocations inside are eligible when the batch's load started."""
        previous = getattr(self._local, "loading", False)
        self._local.loading = getattr(batch, "hicache_consumer_index", -1) >= 0
        try:
            yield
        finally:
            self._local.loading = previous

    def should_miss(self) -> bool:
        if not getattr(self._local, "loading", False):
            return False
        with self._lock:
            self.counts["eligible_allocations"] += 1
            miss = self.counts["injected_misses"] < self.limit
            if miss:
                self.counts["injected_misses"] += 1
                self._local.loading = False  # one miss per batch: its unwind puts it back whole
            self._save()
        return miss

    def load_started(self, producer_index: int) -> None:
        if producer_index >= 0:
            with self._lock:
                self.counts["loads_started"] += 1
                self._save()

    def _save(self) -> None:
        if self.counters_dir is None:
            return
        self.counters_dir.mkdir(parents=True, exist_ok=True)
        target = self.counters_dir / f"{os.getpid()}.json"
        temporary = target.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.counts))
        temporary.replace(target)


def wrap_prepare_for_extend(batch_class: type, injector: Injector) -> None:
    real = batch_class.prepare_for_extend  # type: ignore[attr-defined]

    def prepare_for_extend(self: Any, *args: Any, **kwargs: Any) -> Any:
        with injector.preparing(self):
            return real(self, *args, **kwargs)

    batch_class.prepare_for_extend = prepare_for_extend  # type: ignore[attr-defined]


def wrap_allocators(classes: Sequence[type], injector: Injector) -> list[str]:
    """Wrap `alloc` / `alloc_extend` where each class defines them; returns what was wrapped."""
    wrapped = []
    for cls in classes:
        for name in ALLOC_METHODS:
            real = cls.__dict__.get(name)
            if real is None or getattr(real, "_carry_e2e", False):
                continue

            def make(real: Callable[..., Any]) -> Callable[..., Any]:
                def alloc(self: Any, *args: Any, **kwargs: Any) -> Any:
                    if injector.should_miss():
                        return None
                    return real(self, *args, **kwargs)

                alloc._carry_e2e = True  # type: ignore[attr-defined]
                return alloc

            setattr(cls, name, make(real))
            wrapped.append(f"{cls.__name__}.{name}")
    return wrapped


def wrap_start_loading(controller_class: type, injector: Injector) -> None:
    real = controller_class.start_loading  # type: ignore[attr-defined]

    def start_loading(self: Any) -> int:
        index: int = real(self)
        injector.load_started(index)
        return index

    controller_class.start_loading = start_loading  # type: ignore[attr-defined]


def all_subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                stack.append(sub)
    return found


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a named module has executed (whoever imports it first)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                self._patch_after_exec(spec.loader, self.patches.pop(name))
                return spec
        return None

    @staticmethod
    def _patch_after_exec(loader: Any, patch: Callable[[Any], None]) -> None:
        real_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            patch(module)

        loader.exec_module = exec_module


def install(env: dict[str, str] | os._Environ[str] = os.environ) -> Injector | None:
    if env.get("CARRY_E2E_INJECT") != "1":
        return None
    counters = env.get("CARRY_E2E_COUNTERS_DIR")
    injector = Injector(int(env.get("CARRY_E2E_MISS_LIMIT", "3")), Path(counters) if counters else None)

    def patch_batch(module: Any) -> None:
        wrap_prepare_for_extend(module.ScheduleBatch, injector)
        # The allocators are imported by then (schedule_batch imports the allocator package).
        allocator = sys.modules.get(ALLOCATOR_PACKAGE)
        base = getattr(allocator, "BaseTokenToKVPoolAllocator", None)
        if base is not None:
            wrap_allocators([base, *all_subclasses(base)], injector)

    def patch_controller(module: Any) -> None:
        wrap_start_loading(module.HiCacheController, injector)

    sys.meta_path.insert(0, AfterImport({BATCH_MODULE: patch_batch, CONTROLLER_MODULE: patch_controller}))
    return injector


INJECTOR = install()
