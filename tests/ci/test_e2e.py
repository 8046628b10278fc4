"""ci/e2e on CPU: the miss-injection hook on fake batch/allocator classes, and the driver
(launch, health, bounded traffic, verdicts, killing the process group) against a fake server.
The flags and model configs are checked against the real sglang tree (argparse and config
classes only: nothing here needs a GPU)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci" / "e2e"))
sys.path.insert(0, str(ROOT / "ci" / "e2e" / "hook"))
import run_e2e  # noqa: E402
import sitecustomize as hook  # noqa: E402

FAKE_SERVER = Path(__file__).with_name("fake_sglang_server.py")


# --------------------------------------------------------------------------------------------
# The hook
# --------------------------------------------------------------------------------------------
def fresh_classes() -> dict[str, type]:
    """A batch and two allocators, new for each test (the hook patches classes in place)."""

    class Alloc:
        def __init__(self) -> None:
            self.taken = 0

        def alloc(self, need: int) -> list[int] | None:
            self.taken += need
            return list(range(need))

    class Paged(Alloc):
        def alloc_extend(self, need: int) -> list[int] | None:
            return self.alloc(need)

    class Batch:
        def __init__(self, allocator: Alloc, consumer: int) -> None:
            self.allocator, self.hicache_consumer_index = allocator, consumer

        def prepare_for_extend(self) -> list[int] | None:
            return self.allocator.alloc(4)

    return {"Alloc": Alloc, "Paged": Paged, "Batch": Batch}


def test_hook_misses_only_inside_prepare_for_extend_of_a_loading_batch(tmp_path: Path) -> None:
    classes = fresh_classes()
    injector = hook.Injector(limit=2, counters_dir=tmp_path / "counters")
    hook.wrap_prepare_for_extend(classes["Batch"], injector)
    wrapped = hook.wrap_allocators([classes["Alloc"], classes["Paged"]], injector)
    assert wrapped == ["Alloc.alloc", "Paged.alloc_extend"]
    allocator, batch = classes["Alloc"](), classes["Batch"]
    assert allocator.alloc(3) == [0, 1, 2]  # outside prepare_for_extend: never a miss
    assert batch(allocator, consumer=-1).prepare_for_extend() == [0, 1, 2, 3]  # no load in flight
    assert batch(allocator, consumer=0).prepare_for_extend() is None  # a load in flight: miss
    assert allocator.taken == 7  # the miss took nothing
    assert batch(allocator, consumer=2).prepare_for_extend() is None
    assert batch(allocator, consumer=1).prepare_for_extend() == [0, 1, 2, 3]  # the limit (2) is reached
    counters = json.loads((tmp_path / "counters" / f"{os.getpid()}.json").read_text())
    assert counters == {"eligible_allocations": 3, "injected_misses": 2, "loads_started": 0}


def test_hook_wraps_once_and_counts_loads(tmp_path: Path) -> None:
    injector = hook.Injector(limit=0, counters_dir=None)
    cls = type("Alloc", (), {"alloc": lambda self, n: [n]})
    assert hook.wrap_allocators([cls], injector) == ["Alloc.alloc"]
    assert hook.wrap_allocators([cls], injector) == []  # already wrapped
    controller = type("Controller", (), {"start_loading": lambda self: self.next})
    hook.wrap_start_loading(controller, injector)
    c = controller()
    for c.next in (-1, 0, 2):
        c.start_loading()
    assert injector.counts["loads_started"] == 2


def test_hook_patches_a_module_right_after_it_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "carry_e2e_fake_batch.py").write_text("class ScheduleBatch:\n    patched = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = hook.AfterImport({"carry_e2e_fake_batch": lambda m: setattr(m.ScheduleBatch, "patched", True)})
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module("carry_e2e_fake_batch")
        assert module.ScheduleBatch.patched is True
        assert finder.patches == {}
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("carry_e2e_fake_batch", None)


def test_hook_is_off_without_the_variable() -> None:
    before = list(sys.meta_path)
    assert hook.install({}) is None
    assert hook.install({"CARRY_E2E_INJECT": "0"}) is None
    assert sys.meta_path == before
    injector = hook.install({"CARRY_E2E_INJECT": "1", "CARRY_E2E_MISS_LIMIT": "5"})
    try:
        assert injector is not None and injector.limit == 5
        assert isinstance(sys.meta_path[0], hook.AfterImport)
        assert set(sys.meta_path[0].patches) == {hook.BATCH_MODULE, hook.CONTROLLER_MODULE}
    finally:
        sys.meta_path[:] = before


# --------------------------------------------------------------------------------------------
# The driver, against the fake server
# --------------------------------------------------------------------------------------------
@pytest.fixture
def small_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_e2e, "GROUPS", 3)
    monkeypatch.setattr(run_e2e, "ROUNDS", 2)


def _run(tmp_path: Path, mode: str, kind: str, control: dict[str, list[int]] | None = None) -> Any:
    port = run_e2e.free_port()
    command = [sys.executable, str(FAKE_SERVER), str(port), mode]
    return run_e2e.run_once("dense", kind, command, tmp_path, dict(os.environ), [], control, port, 30)


def test_control_pristine_patched_verdicts(tmp_path: Path, small_traffic: None) -> None:
    control, outcomes = _run(tmp_path, "control", "control")
    assert control.ok, control
    assert control.finished == 6 and control.host_cached_tokens == 3 * 256 and control.injected_misses == 0
    outputs = {o.key: o.output_ids for o in outcomes}

    pristine, _ = _run(tmp_path, "pristine", "pristine", outputs)
    assert pristine.ok and pristine.server_died and pristine.alloc_error_logged, pristine
    assert pristine.verdict == "the scheduler died with the allocation error (as expected)"
    assert pristine.failed > 0

    patched, _ = _run(tmp_path, "patched", "patched", outputs)
    assert patched.ok, patched
    assert patched.injected_misses == 3 and patched.unwinds_logged == 3 and patched.outputs_equal_control
    assert (tmp_path / "dense-patched.log").read_text().startswith("fake server patched")


def test_pristine_that_survives_is_reported_as_fixed_upstream(tmp_path: Path, small_traffic: None) -> None:
    survivor, _ = _run(tmp_path, "survivor", "pristine")
    assert survivor.ok and not survivor.server_died
    assert survivor.verdict.startswith("UPSTREAM FIXED IT")


def test_patched_with_other_outputs_fails(tmp_path: Path, small_traffic: None) -> None:
    _, outcomes = _run(tmp_path, "control", "control")
    skewed, _ = _run(tmp_path, "skewed", "patched", {o.key: o.output_ids for o in outcomes})
    assert not skewed.ok and skewed.outputs_equal_control is False


def test_server_that_never_gets_healthy(tmp_path: Path) -> None:
    port = run_e2e.free_port()
    command = [sys.executable, "-c", "print('Out of memory at start-up'); raise SystemExit(3)"]
    run, _ = run_e2e.run_once("dense", "patched", command, tmp_path, dict(os.environ), [], {}, port, 10)
    assert not run.started and not run.ok and run.failed == run_e2e.GROUPS * run_e2e.ROUNDS


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    port = run_e2e.free_port()
    pid_file = tmp_path / "child.pid"
    command = [sys.executable, str(FAKE_SERVER), str(port), "control", "--child-pid-file", str(pid_file)]
    server = run_e2e.Server.start(command, dict(os.environ), tmp_path / "s.log", port)
    assert server.wait_healthy(30, poll_s=0.1)
    child = int(pid_file.read_text())
    server.stop(grace_s=5)
    assert not server.alive()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server's child outlived it")


def test_hook_reaches_the_server_through_pythonpath(tmp_path: Path) -> None:
    """run_once puts the hook first on the server's PYTHONPATH, so sitecustomize loads there."""
    port = run_e2e.free_port()
    probe = "import sitecustomize as s; print('hook', s.INJECTOR is not None, s.__file__)"
    command = [sys.executable, "-c", probe]
    run_e2e.run_once("dense", "patched", command, tmp_path, dict(os.environ), [], {}, port, 3)
    assert f"hook True {run_e2e.HOOK / 'sitecustomize.py'}" in (tmp_path / "dense-patched.log").read_text()


# --------------------------------------------------------------------------------------------
# Models and flags against the real sglang tree
# --------------------------------------------------------------------------------------------
def test_dense_model_weights_are_seeded_and_complete(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    first = run_e2e.write_models(tmp_path / "a", ["dense"])["dense"]
    second = run_e2e.write_models(tmp_path / "b", ["dense"])["dense"]
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    tensors = load_file(str(first / "model.safetensors"))
    shapes = run_e2e.llama_weight_shapes(run_e2e.DENSE_LLAMA)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes


def test_flags_and_configs_are_what_sglang_reads(tmp_path: Path) -> None:
    importlib.import_module("upstream.conftest")  # puts the sglang tree on sys.path
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_config

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    models = run_e2e.write_models(tmp_path, ["hybrid"])
    for name, (_, _, extra) in run_e2e.MODELS.items():
        args = parser.parse_args(run_e2e.server_command("python", tmp_path / name, 1, extra)[3:])
        assert args.enable_hierarchical_cache and args.hicache_write_policy == "write_through"
        assert args.skip_tokenizer_init and args.max_total_tokens == 1024
    config = get_config(str(models["hybrid"]), trust_remote_code=False)
    assert type(config).__name__ == "Qwen3_5TextConfig"
    assert config.full_attention_layer_ids == [3]  # hybrid: three Gated DeltaNet layers, one attention
