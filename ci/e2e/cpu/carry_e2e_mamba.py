"""Stand-ins for what a hybrid LFM2 model (gated short-conv layers + attention) needs from the kernel
boundary when a real sglang 0.5.23 server serves it on CPU with native HiCache (e2e only).

Loaded, like its sibling carry_e2e_cpu (whose copy streams it queues on), only into the e2e's
server processes; never in a unit-test environment or a built wheel. What stands in, and why:

- `causal_conv1d_fn` / `causal_conv1d_update` (layers/attention/mamba/causal_conv1d.py:94, :162):
  on CPU sglang's wrappers reach the Triton kernels (`_HAS_CONV1D_KERNEL = is_cuda()`, :26), which
  cannot launch there. Here they are plain torch with the Triton kernels' semantics
  (kernels/ops/mamba/causal_conv1d_triton.py) and arithmetic: each product rounded to its
  operands' dtype, accumulated in fp32 in window order starting from the bias, the result rounded
  to x's dtype. The prefill kernel casts the initial state to x's dtype before its products, the
  decode kernel does not. On a GPU, tl.exp may be approximate and fp32 operands may fuse into one
  multiply-add, so silu and fp32 agree to an ulp there, not bit for bit; LFM2 runs bf16 with
  activation=None.
- the two Mamba-state HiCache copy kernels (mem_cache/pool_host/mamba.py binds them only on
  CUDA/HIP, :38-42), over the raw rows kernels/jit/csrc/kvcacheio/transfer_mamba.cuh addresses,
  queued on the current stream as the dense ones are, so a load stays in flight on HiCache's copy
  stream;
- late-copy accounting: how many Mamba load copies landed in a device slot that was released
  after the copy was issued (the hazard an unwind without its load wait leaves), counted from
  `MambaSlotAllocator.free` / `clear`, which every release of a device Mamba slot goes through;
- import-time names only: any hybrid imports the KDA and GDN backends
  (layers/attention/attention_registry.py:410, :431), which import an `sgl_kernel.mamba`
  submodule and read two `torch.ops.sgl_kernel` attributes on CPU. LFM2 never calls them, so each
  raises NotImplementedError. They are attributes, not registered ops, and
  `convert_weight_packed` is never defined, so sglang's AMX check (utils/common.py:353-360) stays
  False and every layer keeps its native torch path.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, MutableMapping
from types import ModuleType
from typing import Any

import carry_e2e_cpu
import torch

PAD_SLOT_ID = -1  # causal_conv1d_triton.py's default
ACTIVATIONS = (None, "silu", "swish")  # swish is silu to both kernels


# --------------------------------------------------------------------------------------------
# The short convolution (causal_conv1d_triton.py)
# --------------------------------------------------------------------------------------------
def _silu(activation: str | bool | None) -> bool:
    if isinstance(activation, bool):  # the Triton launchers take True for silu
        return activation
    if activation not in ACTIVATIONS:
        raise NotImplementedError(f"carry-e2e-mamba: activation {activation!r} (None, silu or swish only)")
    return activation is not None


def _slot(indices: torch.Tensor | None, position: int, slots: int, pad_slot_id: int | None) -> int | None:
    """The cache line of a sequence, or None for a pad entry (the kernels return at once for it)."""
    slot = position if indices is None else int(indices[position])
    if pad_slot_id is not None and slot == pad_slot_id:
        return None
    if not 0 <= slot < slots:  # a kernel would write outside conv_states; torch would wrap around
        raise IndexError(f"carry-e2e-mamba: cache line {slot} outside the {slots} of conv_states")
    return slot


def _convolve(
    window: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    """One output column per position: `window[j]` is the (dim, n) input tap j meets (oldest first)."""
    acc = torch.zeros(window[0].shape, dtype=torch.float32)
    if bias is not None:
        acc = acc + bias.float()[:, None]  # the kernels preload the accumulator with the bias
    for tap, values in enumerate(window):
        acc = acc + (values * weight[:, tap : tap + 1]).float()  # the product rounds to its operands'
    if silu:
        acc = acc / (1 + torch.exp(-acc))
    return acc


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    conv_states: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int | None = PAD_SLOT_ID,
    **kwargs: Any,
) -> torch.Tensor:
    """Prefill, varlen: x (dim, tokens), sequence s at [query_start_loc[s], query_start_loc[s+1]),
    its state in conv_states[cache_indices[s]] (read when has_initial_state[s], then overwritten
    with its last width-1 inputs). A pad entry is skipped: output unwritten, state untouched."""
    kwargs.pop("validate_data", None)  # assertions only, in the Triton launcher
    if kwargs.pop("block_table", None) is not None:
        raise NotImplementedError("carry-e2e-mamba: causal_conv1d_fn(block_table=...) (CUDA-graph launch)")
    seq_lens_cpu = kwargs.pop("seq_lens_cpu", None)
    if kwargs:
        raise NotImplementedError(f"carry-e2e-mamba: causal_conv1d_fn options {sorted(kwargs)}")
    if conv_states is None or query_start_loc is None:
        raise NotImplementedError("carry-e2e-mamba: causal_conv1d_fn needs conv_states and query_start_loc")
    if x.dim() != 2:
        raise NotImplementedError("carry-e2e-mamba: causal_conv1d_fn takes x as (dim, tokens) only")
    dim, width = weight.shape
    if not 2 <= width <= 4:  # the kernel's compute loop has branches for widths 2-4 only
        raise NotImplementedError(f"carry-e2e-mamba: kernel width {width}")
    state_len = width - 1
    if conv_states.shape[1] != dim or conv_states.shape[2] < state_len:
        raise ValueError(f"carry-e2e-mamba: conv_states {tuple(conv_states.shape)} for weight {(dim, width)}")
    silu = _silu(activation)
    starts = [int(v) for v in query_start_loc.tolist()]
    lengths = [end - start for start, end in itertools.pairwise(starts)]
    if seq_lens_cpu is not None and [int(n) for n in seq_lens_cpu] != lengths:
        raise ValueError("carry-e2e-mamba: seq_lens_cpu disagrees with query_start_loc")
    # empty_like in the kernel: positions it never writes (pad entries) are zeros here, not garbage
    out = torch.zeros_like(x)
    for position, (start, length) in enumerate(zip(starts, lengths, strict=False)):
        slot = _slot(cache_indices, position, conv_states.shape[0], pad_slot_id)
        if slot is None or length <= 0:
            continue
        tokens = x[:, start : start + length]
        state = conv_states[slot, :, :state_len]
        initial = has_initial_state is not None and bool(has_initial_state[position])
        prior = state.to(x.dtype) if initial else torch.zeros(dim, state_len, dtype=x.dtype)
        inputs = torch.cat([prior, tokens], dim=1)
        window = [inputs[:, tap : tap + length] for tap in range(width)]
        out[:, start : start + length] = _convolve(window, weight, bias, silu).to(out.dtype)
        # The state keeps its own dtype where it survives the shift (short sequences).
        kept = state.clone() if initial else torch.zeros_like(state)
        state.copy_(torch.cat([kept, tokens.to(state.dtype)], dim=1)[:, -state_len:])
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int | None = PAD_SLOT_ID,
) -> torch.Tensor:
    """Decode: x (batch, dim) or (batch, dim, seqlen), row b's state conv_state[conv_state_indices[b]]
    (its first width-1 columns) shifted left by seqlen and filled with x. A pad entry is skipped."""
    if cache_seqlens is not None:  # a circular buffer to the CUDA kernel; the Triton one never reads it
        raise NotImplementedError("carry-e2e-mamba: causal_conv1d_update(cache_seqlens=...)")
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    dim, width = weight.shape
    if not 2 <= width <= 4:
        raise NotImplementedError(f"carry-e2e-mamba: kernel width {width}")
    state_len = width - 1
    if conv_state.shape[1] != dim or conv_state.shape[2] < state_len:
        raise ValueError(f"carry-e2e-mamba: conv_state {tuple(conv_state.shape)} for weight {(dim, width)}")
    silu = _silu(activation)
    batch, _, seqlen = x3.shape
    out = torch.zeros_like(x3)
    for row in range(batch):
        slot = _slot(conv_state_indices, row, conv_state.shape[0], pad_slot_id)
        if slot is None:
            continue
        state = conv_state[slot, :, :state_len]
        columns = state.clone()  # read before the shift overwrites them, and not cast (unlike prefill)
        tokens = x3[row]
        state.copy_(torch.cat([columns, tokens.to(state.dtype)], dim=1)[:, -state_len:])
        # Taps on the state keep the state's dtype, taps on x keep x's: a list, not one tensor.
        taps = [columns[:, i : i + 1] for i in range(state_len)] + [
            tokens[:, t : t + 1] for t in range(seqlen)
        ]
        for t in range(seqlen):
            out[row, :, t : t + 1] = _convolve(taps[t : t + width], weight, bias, silu).to(out.dtype)
    return out.squeeze(-1) if squeeze else out


CONV_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
}


# --------------------------------------------------------------------------------------------
# Late-copy accounting
# --------------------------------------------------------------------------------------------
_accounting = threading.Lock()
_release_epochs: defaultdict[int, int] = defaultdict(int)
_late_copies = 0
_copies_landed = 0


def note_released(slots: Iterable[int] | torch.Tensor) -> None:
    """Device Mamba slots were released: a load copy into one of them issued before lands late."""
    released = slots.reshape(-1).tolist() if isinstance(slots, torch.Tensor) else list(slots)
    with _accounting:
        for slot in released:
            _release_epochs[int(slot)] += 1


def late_copies() -> int:
    """Load copies (one per destination slot of a kernel call) that landed after their slot's release."""
    with _accounting:
        return _late_copies


def copies_landed() -> int:
    """Load copies (one per destination slot of a kernel call) that landed."""
    with _accounting:
        return _copies_landed


def _epochs(slots: list[int]) -> list[int]:
    with _accounting:
        return [_release_epochs[slot] for slot in slots]


def _land(slots: list[int], issued: list[int], write: Callable[[], None]) -> None:
    """Write and count under the lock, so a release is either wholly before a landing or after it."""
    global _late_copies, _copies_landed
    with _accounting:
        write()
        _copies_landed += len(slots)
        _late_copies += sum(_release_epochs[slot] != epoch for slot, epoch in zip(slots, issued, strict=True))


# --------------------------------------------------------------------------------------------
# The Mamba HiCache copy kernels (transfer_mamba.cuh), over the raw rows the CUDA kernels address
# --------------------------------------------------------------------------------------------
def _check_copy(src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int) -> None:
    # The checks run_pf_lf / run_lf_pf make before launching: a call the GPU refuses fails here too.
    if src_indices.dtype != torch.int64 or dst_indices.dtype != torch.int64:
        raise RuntimeError("carry-e2e-mamba: transfer_mamba indices must be int64")
    if src_indices.shape != dst_indices.shape or src_indices.dim() != 1:
        raise RuntimeError("carry-e2e-mamba: transfer_mamba indices must be two 1-D tensors of one length")
    if item_size <= 0 or item_size % 16 != 0:
        raise RuntimeError(
            f"carry-e2e-mamba: transfer_mamba item_size {item_size} (positive, 16-byte aligned)"
        )


def transfer_kv_mamba_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
) -> None:
    """Load one layer: host page-first rows (all layers of a slot together) to a device layer's slots."""
    _check_copy(src_indices, dst_indices, item_size)
    if src_indices.numel() == 0:
        return
    src_at, dst_at = src_indices.clone(), dst_indices.clone()
    slots = [int(slot) for slot in dst_at.tolist()]
    issued = _epochs(slots)
    start = layer_id * item_size

    def write() -> None:
        rows = carry_e2e_cpu.byte_rows(src, src_layout_dim)[src_at, start : start + item_size]
        carry_e2e_cpu.byte_rows(dst, item_size)[dst_at] = rows

    carry_e2e_cpu.on_current_stream(lambda: _land(slots, issued, write))


def transfer_kv_mamba_lf_pf(
    src_ptrs: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
) -> None:
    """Back up every layer: device layers (by data pointer) to host page-first rows."""
    _check_copy(src_indices, dst_indices, item_size)
    if num_layers <= 0 or src_ptrs.dtype != torch.uint64 or tuple(src_ptrs.shape) != (num_layers,):
        raise RuntimeError(f"carry-e2e-mamba: src_ptrs must be {num_layers} uint64 layer pointers")
    if src_indices.numel() == 0:
        return
    src_at, dst_at = src_indices.clone(), dst_indices.clone()
    rows = int(src_at.max()) + 1
    pointers = [int(pointer) for pointer in src_ptrs.tolist()]

    def copy() -> None:
        host = carry_e2e_cpu.byte_rows(dst, dst_layout_dim)
        for layer, address in enumerate(pointers):
            start = layer * item_size
            host[dst_at, start : start + item_size] = carry_e2e_cpu.rows_at(address, rows, item_size)[src_at]

    carry_e2e_cpu.on_current_stream(copy)


COPY_KERNELS: dict[str, Callable[..., None]] = {
    "transfer_kv_mamba_pf_lf": transfer_kv_mamba_pf_lf,
    "transfer_kv_mamba_lf_pf": transfer_kv_mamba_lf_pf,
}


# --------------------------------------------------------------------------------------------
# Import-time names (never called by LFM2)
# --------------------------------------------------------------------------------------------
class NotHere:
    """A name a module imports on CPU and LFM2 never calls: calling it says which name it was."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self.__name__}: not in the e2e's CPU stand-ins (LFM2 never calls it)")


MAMBA_SUBMODULE = "sgl_kernel.mamba"
# kda_backend.py:39, gdn_backend.py:184, kernels/gdn_triton.py:28
MAMBA_SUBMODULE_NAMES = ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu")
# kernels/gdn_triton.py:31-33, gdn_backend.py:188
TORCH_OP_NAMES = ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu")


def install_import_time_names(
    modules: MutableMapping[str, ModuleType] | None = None, ops: Any = None
) -> None:
    """Create `sgl_kernel.mamba` and the torch.ops.sgl_kernel attributes where missing. `modules`
    and `ops` default to sys.modules and torch.ops.sgl_kernel; a test passes its own."""
    modules = sys.modules if modules is None else modules
    ops = torch.ops.sgl_kernel if ops is None else ops
    parent = modules["sgl_kernel"] if "sgl_kernel" in modules else importlib.import_module("sgl_kernel")
    submodule = modules.get(MAMBA_SUBMODULE)
    if submodule is None:
        submodule = ModuleType(MAMBA_SUBMODULE, "The e2e's CPU stand-in: names imported, never called.")
        modules[MAMBA_SUBMODULE] = submodule
    # vars(), not hasattr: the sgl_kernel stand-in answers every missing attribute with a placeholder.
    if vars(parent).get("mamba") is not submodule:
        vars(parent)["mamba"] = submodule
    for name in MAMBA_SUBMODULE_NAMES:
        if name not in vars(submodule):
            setattr(submodule, name, NotHere(f"{MAMBA_SUBMODULE}.{name}"))
    for name in TORCH_OP_NAMES:
        if not hasattr(ops, name):  # a registered op of that name (a real build) stays
            setattr(ops, name, NotHere(f"torch.ops.sgl_kernel.{name}"))


# --------------------------------------------------------------------------------------------
# Patches, each applied right after its module has run (the hook's AfterImport)
# --------------------------------------------------------------------------------------------
CONV_WRAPPER_MODULE = "sglang.srt.layers.attention.mamba.causal_conv1d"


def patch_conv_wrappers(module: Any) -> None:
    if module._HAS_CONV1D_KERNEL:  # CUDA's compiled kernel: nothing reaches Triton
        return
    for name, function in CONV_FUNCTIONS.items():
        setattr(module, name, function)


def patch_lfm2(module: Any) -> None:
    # lfm2.py imported the wrappers by value: only a copy taken before the wrappers' patch needs it.
    for name, function in CONV_FUNCTIONS.items():
        if getattr(getattr(module, name, None), "__module__", None) == CONV_WRAPPER_MODULE:
            setattr(module, name, function)


def patch_host_pool_kernels(module: Any) -> None:
    for name, kernel in COPY_KERNELS.items():
        if not hasattr(module, name):  # bound only on CUDA/HIP
            setattr(module, name, kernel)


_release_wraps: set[Callable[..., Any]] = set()


def _wraps_release(method: Any) -> bool:
    """Whether `method`, or a function it wraps (functools.wraps' chain), is one of our wraps."""
    while method is not None:
        if method in _release_wraps:
            return True
        method = getattr(method, "__wrapped__", None)
    return False


def patch_slot_release(module: Any) -> None:
    """Every release of a device Mamba slot goes through MambaSlotAllocator.free (or clear, a flush)."""
    allocator = module.MambaSlotAllocator
    if _wraps_release(allocator.free):
        return
    real_free, real_clear = allocator.free, allocator.clear

    @functools.wraps(real_free)
    def free(self: Any, free_index: torch.Tensor) -> Any:
        note_released(free_index)
        return real_free(self, free_index)

    @functools.wraps(real_clear)
    def clear(self: Any) -> Any:
        note_released(range(1, self.size + 1))  # slot 0 is the pad entries' dummy, never handed out
        return real_clear(self)

    _release_wraps.update((free, clear))
    allocator.free, allocator.clear = free, clear


PATCHES: dict[str, Callable[[Any], None]] = {
    CONV_WRAPPER_MODULE: patch_conv_wrappers,
    "sglang.srt.models.lfm2": patch_lfm2,
    "sglang.srt.mem_cache.pool_host.mamba": patch_host_pool_kernels,
    "sglang.srt.mem_cache.allocator.mamba": patch_slot_release,
}
