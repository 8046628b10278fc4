"""The HiCache "direct" copies of sgl_kernel.kvcacheio, as torch indexing copies (see __init__).

Layouts, as sglang's host pools use them (mem_cache/pool_host): a layer-first tensor is indexed
by token (or Mamba slot) on its first dimension; a page-first host buffer is
[pages, layers, page_size, ...], token t living at [t // page_size, layer, t % page_size].
Each copy runs on the current stream, like the kernels it stands for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from carry_standin import Placeholder


def _on(indices: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    return indices.to(tensor.device, non_blocking=True).long()


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[_on(dst_indices, dst)] = src[_on(src_indices, src)].to(dst.device, non_blocking=True)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        s = _on(src_indices, src)
        dst[_on(dst_indices, dst)] = src[s // page_size, layer_id, s % page_size].to(
            dst.device, non_blocking=True
        )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    layers = len(src_ptrs) // len(dst_ptrs)
    for i, src in enumerate(src_ptrs):
        dst = dst_ptrs[i // layers]
        d = _on(dst_indices, dst)
        dst[d // page_size, i % layers, d % page_size] = src[_on(src_indices, src)].to(
            dst.device, non_blocking=True
        )


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder(f"sgl_kernel.kvcacheio.{name}")
