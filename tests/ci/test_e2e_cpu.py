"""ci/e2e/cpu: the stand-ins the CPU servers load, checked against direct indexing, and the copy
streams' ordering (a copy lands later, and a wait on a host stream blocks until it has).

Nothing here installs them: torch.cpu stays as it is in this process, and the sgl_kernel stand-in
is loaded under another name so no later test can import it as sgl_kernel."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

CPU = Path(__file__).resolve().parents[2] / "ci" / "e2e" / "cpu"
sys.path.insert(0, str(CPU))
import carry_e2e_cpu as cpu  # noqa: E402


def load_kernel_standin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("carry_e2e_sgl_kernel", CPU / "sgl_kernel" / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOKENS, LAYERS, HEADS, DIM = 12, 3, 2, 4


def host_and_device() -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    host = torch.randn(TOKENS, LAYERS, HEADS, DIM, generator=generator).to(torch.bfloat16)  # page_first
    device = [torch.randn(TOKENS, HEADS, DIM, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]
    return host, device


ITEM = HEADS * DIM * 2  # bytes per token per layer (bf16)


def test_importing_the_standins_patches_nothing() -> None:
    # As objects: mypy sees torch's own and the stand-ins' types as never the same, which this checks.
    event: object = torch.cpu.Event
    current_stream: object = torch.cpu.current_stream
    assert event is not cpu.Event and current_stream is not cpu.current_stream


def test_load_kernel_copies_one_layer_from_host_rows() -> None:
    host_k, device_k = host_and_device()
    host_v, device_v = host_and_device()
    src, dst = torch.tensor([5, 0, 7]), torch.tensor([1, 9, 3])
    cpu.transfer_kv_per_layer_pf_lf(
        host_k, device_k[2], host_v, device_v[2], src, dst, 2, ITEM, ITEM * LAYERS
    )
    assert torch.equal(device_k[2][dst], host_k[src, 2]) and torch.equal(device_v[2][dst], host_v[src, 2])


def test_backup_kernel_copies_every_layer_by_data_pointer() -> None:
    host_k, device_k = host_and_device()
    host_v, device_v = host_and_device()
    pointers_k = torch.tensor([t.data_ptr() for t in device_k], dtype=torch.uint64)
    pointers_v = torch.tensor([t.data_ptr() for t in device_v], dtype=torch.uint64)
    src, dst = torch.tensor([4, 11, 2]), torch.tensor([0, 6, 8])
    cpu.transfer_kv_all_layer_lf_pf(
        pointers_k, host_k, pointers_v, host_v, src, dst, ITEM, ITEM * LAYERS, LAYERS
    )
    for layer in range(LAYERS):
        assert torch.equal(host_k[dst, layer], device_k[layer][src])
        assert torch.equal(host_v[dst, layer], device_v[layer][src])


def test_a_copy_on_a_copy_stream_lands_later_and_a_host_wait_waits_for_it() -> None:
    host_k, device_k = host_and_device()
    host_v, device_v = host_and_device()
    before = device_k[0].clone()
    src, dst = torch.tensor([1, 2]), torch.tensor([3, 4])
    copies = cpu.CopyStream("test", delay_s=0.3)
    done = cpu.Event()
    with cpu.stream(copies):
        cpu.transfer_kv_per_layer_pf_lf(
            host_k, device_k[0], host_v, device_v[0], src, dst, 0, ITEM, ITEM * LAYERS
        )
        done.record()
    assert torch.equal(device_k[0], before) and not done.query()  # queued, not landed
    started = time.monotonic()
    cpu.current_stream().wait_event(done)  # the forward's LayerLoadingEvent.wait
    assert time.monotonic() - started >= 0.2
    assert done.query() and torch.equal(device_k[0][dst], host_k[src, 0])


def test_events_recorded_on_a_host_stream_complete_at_once() -> None:
    event = cpu.Event()
    assert event.query()  # never recorded: nothing to wait for (as on CUDA)
    event.record()
    assert event.query()
    event.synchronize()


def test_a_stream_context_can_be_entered_again() -> None:
    copies = cpu.CopyStream("reuse", delay_s=0.0)
    context = cpu.stream(copies)
    for _ in range(2):
        with context:
            assert cpu.current_stream() is copies
        assert cpu.current_stream() is not copies


def test_a_failed_copy_is_raised_by_the_next_use_and_by_any_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = cpu.CopyStream("failing", delay_s=0.0)
    monkeypatch.setattr(cpu, "_copy_streams", [copies])
    landed = cpu.Event()

    def failing_copy() -> None:
        raise ZeroDivisionError("division by zero")

    with cpu.stream(copies):
        cpu.on_current_stream(failing_copy)
        landed.record()
    deadline = time.monotonic() + 10
    while not copies.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="failing failed earlier"):
        cpu.current_stream().wait_event(landed)  # the record after it completed; the copy did not
    with pytest.raises(RuntimeError, match="failing failed earlier"):
        copies.enqueue(lambda: None)


def test_sgl_kernel_cpu_ops() -> None:
    kernel = load_kernel_standin()
    req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 0]),
        torch.tensor([4, 2]),
        torch.arange(10, 15),
        8,
    )
    assert req_to_token[2, 1:4].tolist() == [10, 11, 12] and req_to_token[0, :2].tolist() == [13, 14]
    assert int(req_to_token.sum()) == 10 + 11 + 12 + 13 + 14

    buffers = [torch.arange(20, dtype=torch.int64).reshape(10, 2) * (i + 1) for i in range(2)]
    expected = [b.clone() for b in buffers]
    for b in expected:
        b[[7, 8]] = b[[1, 2]]
    pointers = torch.tensor([b.data_ptr() for b in buffers])
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    kernel.copy_all_layer_kv_cache_cpu(pointers, strides, torch.tensor([7, 8]), torch.tensor([1, 2]))
    assert all(torch.equal(b, e) for b, e in zip(buffers, expected, strict=True))
    with pytest.raises(NotImplementedError, match="not in the e2e's CPU stand-in"):
        kernel.verify_tree_greedy()


def test_a_host_pool_never_asks_for_pinned_memory() -> None:
    class HostKVCache:
        def __init__(self, size: int, pin_memory: bool = True) -> None:
            self.size, self.pin_memory = size, pin_memory

    cpu.patch_host_pool_pinning(SimpleNamespace(HostKVCache=HostKVCache))
    pool = HostKVCache(8, pin_memory=True)
    assert pool.size == 8 and pool.pin_memory is False
    assert cpu.PATCHES["sglang.srt.mem_cache.pool_host.base"] is cpu.patch_host_pool_pinning
