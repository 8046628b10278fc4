"""A stand-in for sgl_kernel's CPU build (not on PyPI), for the e2e's CPU servers only.

With SGLANG_USE_CPU_ENGINE=1 sglang imports two mem-cache ops from it unconditionally
(mem_cache/allocation.py: assign_req_to_token_pool_cpu; kernels/ops/kvcache/cache_move.py:
copy_all_layer_kv_cache_cpu): here they are plain torch. Every other name (the speculative ops
imported at module level) is a placeholder that raises if it is ever called. No op is
registered under torch.ops.sgl_kernel, so sglang's AMX check is False and every layer takes its
native torch path.
"""

from __future__ import annotations

from typing import Any

import torch
from carry_e2e_cpu import rows_at

__version__ = "0.0.0+carry.e2e.cpu"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """Row r of the batch gets out_cache_loc's next (end - start) slots at [start, end)."""
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(req_to_token.dtype)
        taken += end - start


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every buffer (a data pointer and its row stride in bytes), row src_loc[i] to tgt_loc[i]."""
    if tgt_loc.numel() == 0:
        return
    targets, sources = tgt_loc.long(), src_loc.long()
    rows = int(max(targets.max(), sources.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        buffer = rows_at(int(address), rows, int(stride))
        buffer[targets] = buffer[sources].clone()


class _Missing:
    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{self.__name__}: not in the e2e's CPU stand-in")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
