"""ci/e2e/cpu/carry_e2e_mamba.py: the hybrid (LFM2) stand-ins the CPU servers load, each checked
against a naive loop written from the real kernel's source, or through sglang's own host pool.

Nothing here installs them: no sglang module or torch namespace of this process is patched (the
copy kernels are bound into the host-pool module only for the length of one test, by monkeypatch,
and the release wrap goes onto a subclass of sglang's allocator made for the test)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "ci" / "e2e" / "cpu"
sys.path.insert(0, str(CPU))
import carry_e2e_cpu as cpu  # noqa: E402
import carry_e2e_mamba as mamba  # noqa: E402

WAIT_S = 20.0  # every wait on a copy stream's worker is bounded by this


def sglang_module(name: str) -> Any:
    importlib.import_module("upstream.conftest")  # puts the sglang tree on sys.path
    return importlib.import_module(name)


# --------------------------------------------------------------------------------------------
# Naive loops, per sequence, per channel, per token, as the Triton kernels' text reads
# (kernels/ops/mamba/causal_conv1d_triton.py)
# --------------------------------------------------------------------------------------------
def naive_output(
    taps: list[torch.Tensor], weights: torch.Tensor, bias: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    """`acc = acc_preload` (the bias, fp32), then `acc += matrix_x * matrix_w` tap by tap: the product
    in the operands' dtype, the sum in fp32; silu as `acc / (1 + exp(-acc))`."""
    acc = bias.float() if bias is not None else torch.zeros((), dtype=torch.float32)
    for j, value in enumerate(taps):
        acc = acc + (value * weights[j]).float()
    return acc / (1 + torch.exp(-acc)) if silu else acc


def naive_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    starts: list[int],
    cache_indices: list[int],
    initial: list[bool],
    states: torch.Tensor,
    silu: bool,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """_causal_conv1d_fwd_kernel, one (sequence, channel) at a time; updates `states` in place."""
    dim, width = weight.shape
    state_len = width - 1
    out = torch.zeros_like(x)
    for seq in range(len(starts) - 1):
        start, seqlen = starts[seq], starts[seq + 1] - starts[seq]
        line = cache_indices[seq]
        if line == pad_slot_id or seqlen <= 0:  # `return` before anything is read or written
            continue
        for c in range(dim):
            old = [states[line, c, k].clone() for k in range(state_len)]
            # load_init_state: conv_states cast to x's dtype; otherwise zeros of x's dtype
            cols = (
                [v.to(x.dtype) for v in old] if initial[seq] else [torch.zeros((), dtype=x.dtype)] * state_len
            )
            for t in range(seqlen):
                token = x[c, start + t]
                out[c, start + t] = naive_output(
                    [*cols, token], weight[c], bias[c] if bias is not None else None, silu
                ).to(x.dtype)
                cols = [*cols[1:], token]
            # STEP 2: the new conv_state
            for k in range(state_len):
                if state_len <= seqlen:
                    states[line, c, k] = x[c, start + seqlen - state_len + k]
                elif k + seqlen < state_len:  # shifted left: the old state where it survives, or zeros
                    states[line, c, k] = old[k + seqlen] if initial[seq] else 0
                else:
                    states[line, c, k] = x[c, start + k - (state_len - seqlen)]
    return out


def naive_decode(
    x: torch.Tensor,
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    indices: list[int],
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """_causal_conv1d_update_kernel for one token per sequence: the state's columns are NOT cast;
    the state is rolled left by one and the token appended."""
    dim, width = weight.shape
    out = torch.zeros_like(x)
    for row, line in enumerate(indices):
        if line == pad_slot_id:
            continue
        for c in range(dim):
            cols = [states[line, c, k].clone() for k in range(width - 1)]
            token = x[row, c]
            out[row, c] = naive_output(
                [*cols, token], weight[c], bias[c] if bias is not None else None, silu
            ).to(x.dtype)
            for k in range(width - 2):
                states[line, c, k] = cols[k + 1]
            states[line, c, width - 2] = token
    return out


# --------------------------------------------------------------------------------------------
# causal_conv1d_fn (prefill)
# --------------------------------------------------------------------------------------------
DIM, LINES = 12, 9
# Sequences of 5, 1 (shorter than the state), 13 (past a Triton chunk), 2, 4 and 9 tokens; the
# fourth is a pad entry; lines out of order, line 0 and 8 never used.
LENGTHS = [5, 1, 13, 2, 4, 9]
CACHE_INDICES = [6, 2, 5, -1, 1, 3]
INITIAL = [True, True, False, True, False, True]


def prefill_inputs(
    dtype: torch.dtype, state_dtype: torch.dtype, width: int, with_bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(DIM, sum(LENGTHS), generator=generator) * 2).to(dtype)
    weight = (torch.randn(DIM, width, generator=generator) * 0.6).to(dtype)
    bias = torch.randn(DIM, generator=generator).to(dtype) if with_bias else None
    states = torch.randn(LINES, DIM, width - 1, generator=generator).to(state_dtype)
    return x, weight, bias, states


def starts_of(lengths: list[int]) -> list[int]:
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return starts


def run_prefill(
    dtype: torch.dtype, state_dtype: torch.dtype, width: int, with_bias: bool, activation: str | None
) -> None:
    x, weight, bias, states = prefill_inputs(dtype, state_dtype, width, with_bias)
    starts = starts_of(LENGTHS)
    expected_states = states.clone()
    expected = naive_prefill(
        x, weight, bias, starts, CACHE_INDICES, INITIAL, expected_states, activation == "silu"
    )
    before = states.clone()
    x_before = x.clone()
    out = mamba.causal_conv1d_fn(
        x,
        weight,
        bias,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        cache_indices=torch.tensor(CACHE_INDICES, dtype=torch.int32),
        has_initial_state=torch.tensor(INITIAL),
        conv_states=states,
        activation=activation,
    )
    assert out.dtype == x.dtype and out.shape == x.shape and torch.equal(x, x_before)
    assert torch.equal(out, expected)
    assert torch.equal(states, expected_states)
    # the pad entry: nothing written (zeros here), though its inputs are not zeros; its line untouched
    pad = slice(starts[3], starts[4])
    assert torch.count_nonzero(out[:, pad]) == 0 and torch.count_nonzero(x[:, pad]) > 0
    for line in (0, 4, 7, 8):  # never named (4 and 7), or only by no one
        assert torch.equal(states[line], before[line])
    for line in (6, 2, 5, 1, 3):  # every named line was written
        assert not torch.equal(states[line], before[line])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_prefill_equals_the_kernels_loop(dtype: torch.dtype, with_bias: bool, activation: str | None) -> None:
    run_prefill(dtype, dtype, 3, with_bias, activation)


@pytest.mark.parametrize("width", [2, 4])
def test_prefill_other_kernel_widths(width: int) -> None:
    run_prefill(torch.bfloat16, torch.bfloat16, width, True, None)


def test_prefill_casts_the_initial_state_to_x_dtype() -> None:
    # An fp32 state: the kernel rounds it to bf16 before the products (the decode kernel does not).
    run_prefill(torch.bfloat16, torch.float32, 3, True, None)


def test_prefill_options_it_does_not_implement_raise() -> None:
    x, weight, bias, states = prefill_inputs(torch.float32, torch.float32, 3, True)
    common: dict[str, Any] = {"query_start_loc": torch.tensor([0, 4]), "conv_states": states}
    for kwargs in ({"block_table": torch.zeros(1, 2)}, {"made_up": 1}, {"activation": "gelu"}):
        with pytest.raises(NotImplementedError):
            mamba.causal_conv1d_fn(x[:, :4], weight, bias, **common, **kwargs)
    with pytest.raises(NotImplementedError):
        mamba.causal_conv1d_fn(x[:, :4], weight, bias, query_start_loc=torch.tensor([0, 4]))
    with pytest.raises(NotImplementedError):
        mamba.causal_conv1d_fn(x[:, :4].unsqueeze(0), weight, bias, **common)
    with pytest.raises(IndexError):  # a line past the cache: a kernel would write out of bounds
        mamba.causal_conv1d_fn(x[:, :4], weight, bias, **common, cache_indices=torch.tensor([LINES]))


# --------------------------------------------------------------------------------------------
# causal_conv1d_update (decode)
# --------------------------------------------------------------------------------------------
DECODE_INDICES = [3, -1, 0, 8, 5]


@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_decode_equals_the_kernels_loop(
    dtype: torch.dtype, state_dtype: torch.dtype, with_bias: bool, activation: str | None
) -> None:
    _, weight, bias, states = prefill_inputs(dtype, state_dtype, 3, with_bias, seed=1)
    x = (torch.randn(len(DECODE_INDICES), DIM, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    expected_states = states.clone()
    expected = naive_decode(x, expected_states, weight, bias, activation == "silu", DECODE_INDICES)
    before = states.clone()
    out = mamba.causal_conv1d_update(
        x,
        states,
        weight,
        bias,
        activation=activation,
        conv_state_indices=torch.tensor(DECODE_INDICES, dtype=torch.int32),
    )
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, expected) and torch.equal(states, expected_states)
    assert torch.count_nonzero(out[1]) == 0  # the pad entry
    for line in range(LINES):
        assert torch.equal(states[line], before[line]) == (line not in DECODE_INDICES)
    # rolled: the old second column moved to the first, the token appended
    assert torch.equal(states[3, :, 0], before[3, :, 1]) and torch.equal(
        states[3, :, 1], x[0].to(state_dtype)
    )


def test_decode_options_it_does_not_implement_raise() -> None:
    _, weight, bias, states = prefill_inputs(torch.float32, torch.float32, 3, True)
    x = torch.ones(1, DIM)
    with pytest.raises(NotImplementedError):
        mamba.causal_conv1d_update(x, states, weight, bias, cache_seqlens=torch.tensor([1]))
    with pytest.raises(NotImplementedError):
        mamba.causal_conv1d_update(x, states, weight, bias, activation="relu")
    with pytest.raises(NotImplementedError):
        mamba.causal_conv1d_update(x, states, weight[:, :1].repeat(1, 5), bias)


# --------------------------------------------------------------------------------------------
# The real Triton kernels' text, run by Triton's interpreter on this CPU, in a child process
# (TRITON_INTERPRET must be set before triton is imported). fp16 and fp32: the interpreter's bf16
# arithmetic is broken (bits taken for integers), fp16's follows the same rounding rule.
# --------------------------------------------------------------------------------------------
INTERPRETED = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import torch
    import sglang.kernels.ops.mamba.causal_conv1d_triton as triton_conv
    import carry_e2e_mamba as mamba

    for x_dtype, state_dtype in [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                 (torch.float32, torch.float32)]:
        for width in (2, 3, 4):
            g = torch.Generator().manual_seed(width)
            lengths, lines, initial = [5, 1, 11, 2, 3], [4, 0, 2, -1, 6], [1, 1, 0, 1, 0]
            x = (torch.randn(16, sum(lengths), generator=g) * 2).to(x_dtype)
            w = (torch.randn(16, width, generator=g) * 0.6).to(x_dtype)
            b = torch.randn(16, generator=g).to(x_dtype)
            states = torch.randn(7, 16, width - 1, generator=g).to(state_dtype)
            starts = torch.tensor([0, 5, 6, 17, 19, 22], dtype=torch.int32)  # of `lengths`
            ours, theirs = states.clone(), states.clone()
            kwargs = dict(cache_indices=torch.tensor(lines, dtype=torch.int32),
                          has_initial_state=torch.tensor(initial, dtype=torch.bool), activation=None)
            expected = triton_conv.causal_conv1d_fn(x, w, b, theirs, starts, lengths, **kwargs)
            got = mamba.causal_conv1d_fn(x, w, b, query_start_loc=starts, conv_states=ours, **kwargs)
            keep = torch.ones(x.shape[1], dtype=torch.bool)
            keep[17:19] = False  # the pad entry (line -1): empty_like there, never written
            assert torch.equal(got[:, keep], expected[:, keep]), ("prefill", x_dtype, state_dtype, width)
            assert torch.equal(ours, theirs), ("prefill state", x_dtype, state_dtype, width)
            tokens = (torch.randn(4, 16, generator=g) * 2).to(x_dtype)
            indices = torch.tensor([2, -1, 5, 0], dtype=torch.int32)
            expected = triton_conv.causal_conv1d_update(tokens, theirs, w, b, conv_state_indices=indices)
            got = mamba.causal_conv1d_update(tokens, ours, w, b, conv_state_indices=indices)
            rows = indices != -1
            assert torch.equal(got[rows], expected[rows]), ("decode", x_dtype, state_dtype, width)
            assert torch.equal(ours, theirs), ("decode state", x_dtype, state_dtype, width)
    print("interpreted kernels agree")
    """
)


def test_conv_equals_the_triton_kernels_run_by_the_interpreter() -> None:
    pytest.importorskip("triton")
    tree = sglang_module("upstream.conftest").upstream_tree("sglang")
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED, str(tree), str(CPU)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and "interpreted kernels agree" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# The Mamba copy kernels, through sglang's own MambaPoolHost (mem_cache/pool_host/mamba.py)
# --------------------------------------------------------------------------------------------
LAYERS, SLOTS = 3, 8


@pytest.mark.parametrize("temporal_shape", [(1, DIM, 0), (2, 4, 8)], ids=["conv-only", "with-ssm-state"])
def test_backup_then_load_round_trip_through_sglangs_host_pool(
    monkeypatch: pytest.MonkeyPatch, temporal_shape: tuple[int, ...]
) -> None:
    pool_host = sglang_module("sglang.srt.mem_cache.pool_host.mamba")
    info_class = sglang_module("sglang.srt.mem_cache.device_pool_info").MambaStateBufferInfo
    for name, kernel in mamba.COPY_KERNELS.items():
        monkeypatch.setattr(pool_host, name, kernel, raising=False)  # bound only on CUDA/HIP there
    generator = torch.Generator().manual_seed(3)
    temporal = torch.randn(LAYERS, SLOTS + 1, *temporal_shape, generator=generator)
    # LFM2's conv state (dim, width - 1) in bf16, and a second conv state of another shape
    convs = (
        torch.randn(LAYERS, SLOTS + 1, DIM, 2, generator=generator).to(torch.bfloat16),
        torch.randn(LAYERS, SLOTS + 1, 4, 8, generator=generator).to(torch.bfloat16),
    )
    host = pool_host.MambaPoolHost(
        info_class(temporal=temporal, conv=convs),
        2.0,
        0,
        device_capacity=SLOTS,
        pin_memory=False,
        device="cpu",
        layout="page_first",
    )
    host_slots, device_slots = host.alloc(3), torch.tensor([4, 1, 6])
    host.backup_from_device_all_layer(None, host_slots, device_slots, io_backend="kernel")
    # transfer_mamba.cuh's page-first host rows: page, then layer, then the item
    for page, slot in zip(host_slots.tolist(), device_slots.tolist(), strict=True):
        for layer in range(LAYERS):
            for conv, host_conv in zip(convs, host.conv_buffer, strict=True):
                assert torch.equal(host_conv[page, layer, 0], conv[layer, slot])
            assert torch.equal(host.temporal_buffer[page, layer, 0], temporal[layer, slot])
    saved = [conv[:, device_slots].clone() for conv in convs], temporal[:, device_slots].clone()
    for tensor in (*convs, temporal):
        tensor.zero_()
    targets = torch.tensor([2, 7, 3])
    for layer in range(LAYERS):
        host.load_to_device_per_layer(None, host_slots, targets, layer, io_backend="kernel")
    for conv, expected in zip(convs, saved[0], strict=True):
        assert torch.equal(conv[:, targets], expected)
    assert torch.equal(temporal[:, targets], saved[1])
    others = [s for s in range(SLOTS + 1) if s not in targets.tolist()]
    assert all(torch.count_nonzero(t[:, others]) == 0 for t in (*convs, temporal))


def test_copy_kernels_refuse_what_the_cuda_launchers_refuse() -> None:
    rows = torch.zeros(4, 2, 16, dtype=torch.uint8)
    layer = torch.zeros(4, 16, dtype=torch.uint8)
    index = torch.tensor([1])
    with pytest.raises(RuntimeError, match="int64"):
        mamba.transfer_kv_mamba_pf_lf(rows, layer, index.int(), index, 0, 16, 32)
    with pytest.raises(RuntimeError, match="16-byte"):
        mamba.transfer_kv_mamba_pf_lf(rows, layer, index, index, 0, 8, 32)
    with pytest.raises(RuntimeError, match="uint64"):
        mamba.transfer_kv_mamba_lf_pf(torch.tensor([layer.data_ptr()]), rows, index, index, 16, 32, 1)


# --------------------------------------------------------------------------------------------
# Late-copy accounting, on a copy stream as HiCache's runs its loads
# --------------------------------------------------------------------------------------------
def host_rows_and_layer() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    host = torch.randn(6, LAYERS, DIM, 2, generator=generator).to(torch.bfloat16)  # page-first
    return host, torch.zeros(SLOTS + 1, DIM, 2, dtype=torch.bfloat16)


ITEM = DIM * 2 * 2  # bytes of one slot's conv state (bf16)


def load(host: torch.Tensor, layer: torch.Tensor, page: int, slot: int) -> None:
    mamba.transfer_kv_mamba_pf_lf(
        host, layer, torch.tensor([page]), torch.tensor([slot]), 1, ITEM, ITEM * LAYERS
    )


def hold(gate: threading.Event) -> None:
    """Work for a copy stream's worker: it stays here, and the loads queued after it in flight."""
    gate.wait(WAIT_S)


def drain(copies: cpu.CopyStream) -> None:
    landed = threading.Event()
    copies.enqueue(landed.set)
    assert landed.wait(WAIT_S), "the copy stream's worker did not reach the end of its queue"
    copies.raise_failure()


def released_allocator() -> Any:
    """sglang's MambaSlotAllocator with the release wrap, on a subclass: sglang's class stays as it is."""
    real = sglang_module("sglang.srt.mem_cache.allocator.mamba").MambaSlotAllocator
    module = SimpleNamespace(MambaSlotAllocator=type("WrappedAllocator", (real,), {}))
    mamba.patch_slot_release(module)
    wrapped = module.MambaSlotAllocator.free
    mamba.patch_slot_release(module)  # idempotent: wrapped once
    assert module.MambaSlotAllocator.free is wrapped and real.free is not wrapped
    return module.MambaSlotAllocator(size=SLOTS, device="cpu")


def test_a_load_landing_after_its_slot_was_released_is_counted() -> None:
    host, layer = host_rows_and_layer()
    allocator = released_allocator()
    slot = allocator.alloc(1)
    copies, gate = cpu.CopyStream("mamba-late", delay_s=0.0), threading.Event()
    late, landed = mamba.late_copies(), mamba.copies_landed()
    pages, targets = torch.tensor([2]), slot.clone()
    with cpu.stream(copies):
        copies.enqueue(lambda: hold(gate))
        mamba.transfer_kv_mamba_pf_lf(host, layer, pages, targets, 1, ITEM, ITEM * LAYERS)
    pages.fill_(0)  # the caller's index tensors are reused after the launch: the copy took its own
    targets.fill_(SLOTS)
    assert torch.count_nonzero(layer) == 0  # queued, not landed
    allocator.free(slot)  # the unwind releases the load's target...
    allocator.free(allocator.alloc(1))  # ...and another slot's release does not count
    gate.set()
    drain(copies)
    assert torch.equal(layer[int(slot)], host[2, 1])  # it landed, late, where it was issued to
    assert torch.count_nonzero(layer[SLOTS]) == 0
    assert (mamba.late_copies() - late, mamba.copies_landed() - landed) == (1, 1)


def test_a_release_after_the_load_landed_is_not_late() -> None:
    host, layer = host_rows_and_layer()
    allocator = released_allocator()
    slot = allocator.alloc(1)
    copies = cpu.CopyStream("mamba-in-time", delay_s=0.0)
    late, landed = mamba.late_copies(), mamba.copies_landed()
    with cpu.stream(copies):
        load(host, layer, 3, int(slot))
    drain(copies)
    allocator.free(slot)
    allocator.clear()  # a flush releases every slot: also after the landing
    assert torch.equal(layer[int(slot)], host[3, 1])
    assert (mamba.late_copies() - late, mamba.copies_landed() - landed) == (0, 1)


def test_a_flush_while_a_load_is_in_flight_is_counted() -> None:
    host, layer = host_rows_and_layer()
    allocator = released_allocator()
    copies, gate = cpu.CopyStream("mamba-flush", delay_s=0.0), threading.Event()
    late = mamba.late_copies()
    with cpu.stream(copies):
        copies.enqueue(lambda: hold(gate))
        load(host, layer, 0, 5)
    allocator.clear()
    gate.set()
    drain(copies)
    assert mamba.late_copies() - late == 1


# --------------------------------------------------------------------------------------------
# Import-time names and the patches
# --------------------------------------------------------------------------------------------
def test_import_time_names_raise_naming_themselves() -> None:
    parent, ops = ModuleType("sgl_kernel"), SimpleNamespace()
    modules: dict[str, ModuleType] = {"sgl_kernel": parent}
    mamba.install_import_time_names(modules, ops)
    submodule = modules[mamba.MAMBA_SUBMODULE]
    assert vars(parent)["mamba"] is submodule
    first = {name: getattr(submodule, name) for name in mamba.MAMBA_SUBMODULE_NAMES}
    mamba.install_import_time_names(modules, ops)  # idempotent
    assert modules[mamba.MAMBA_SUBMODULE] is submodule
    for name in mamba.MAMBA_SUBMODULE_NAMES:
        assert getattr(submodule, name) is first[name]
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.mamba.{name}"):
            getattr(submodule, name)(torch.zeros(1))
    for name in mamba.TORCH_OP_NAMES:
        with pytest.raises(NotImplementedError, match=f"torch.ops.sgl_kernel.{name}"):
            getattr(ops, name)()
    assert not hasattr(ops, "convert_weight_packed")  # sglang's AMX check stays False


def module_level_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """What runs when a module is imported: every node outside function and class bodies."""
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                stack.append(child)
            else:
                yield from ast.walk(child)


def test_import_time_names_are_those_the_linear_attention_backends_take_at_import() -> None:
    tree = sglang_module("upstream.conftest").upstream_tree("sglang")
    imported, ops = set(), set()
    for path in (tree / "sglang/srt/layers/attention/linear").rglob("*.py"):
        for node in module_level_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == mamba.MAMBA_SUBMODULE:
                imported |= {alias.name for alias in node.names}
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.ops.sgl_kernel":
                ops.add(node.attr)
    assert imported == set(mamba.MAMBA_SUBMODULE_NAMES) and ops == set(mamba.TORCH_OP_NAMES)


def test_importing_the_standins_installs_nothing() -> None:
    assert mamba.MAMBA_SUBMODULE not in sys.modules
    assert not any(hasattr(torch.ops.sgl_kernel, name) for name in mamba.TORCH_OP_NAMES)
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def test_patches_set_only_what_is_missing() -> None:
    wrappers = SimpleNamespace(
        _HAS_CONV1D_KERNEL=False, causal_conv1d_fn=object(), causal_conv1d_update=object()
    )
    mamba.patch_conv_wrappers(wrappers)
    assert wrappers.causal_conv1d_fn is mamba.causal_conv1d_fn
    assert wrappers.causal_conv1d_update is mamba.causal_conv1d_update
    compiled = SimpleNamespace(_HAS_CONV1D_KERNEL=True, causal_conv1d_fn=None)
    mamba.patch_conv_wrappers(compiled)
    assert compiled.causal_conv1d_fn is None

    def wrapper() -> None:
        pass

    wrapper.__module__ = mamba.CONV_WRAPPER_MODULE
    lfm2 = SimpleNamespace(causal_conv1d_fn=wrapper, causal_conv1d_update=mamba.causal_conv1d_update)
    mamba.patch_lfm2(lfm2)  # a copy taken before the wrappers' patch
    assert lfm2.causal_conv1d_fn is mamba.causal_conv1d_fn
    assert lfm2.causal_conv1d_update is mamba.causal_conv1d_update

    def real_kernel() -> None:
        pass

    pool = SimpleNamespace(transfer_kv_mamba_pf_lf=real_kernel)
    mamba.patch_host_pool_kernels(pool)
    assert pool.transfer_kv_mamba_pf_lf is real_kernel
    assert vars(pool)["transfer_kv_mamba_lf_pf"] is mamba.transfer_kv_mamba_lf_pf


def test_patched_modules_and_call_sites_are_those_of_the_tree() -> None:
    tree = sglang_module("upstream.conftest").upstream_tree("sglang")
    for name in mamba.PATCHES:
        assert (tree / (name.replace(".", "/") + ".py")).is_file(), name
    lfm2 = (tree / "sglang/srt/models/lfm2.py").read_text()
    # lfm2.py takes both wrappers by value from the module the first patch rebinds
    assert "from sglang.srt.layers.attention.mamba.causal_conv1d import (\n    causal_conv1d_fn," in lfm2
    pool_host = (tree / "sglang/srt/mem_cache/pool_host/mamba.py").read_text()
    for name in mamba.COPY_KERNELS:
        assert f"            {name}(\n" in pool_host
