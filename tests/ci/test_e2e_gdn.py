"""ci/e2e/cpu/carry_e2e_gdn.py: the gated-delta-net (Qwen3.5) stand-ins the CPU servers load, each
checked against a naive loop written from the real kernel's text (exact, or a stated tolerance),
against the real Triton kernels run by Triton's interpreter where this environment has Triton, and
the Mamba copy kernels through sglang's own host pool with this model's state shapes.

Nothing here installs them: no sglang module or torch namespace of this process is patched."""

from __future__ import annotations

import ast
import importlib
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "ci" / "e2e" / "cpu"
sys.path.insert(0, str(CPU))
import carry_e2e_gdn as gdn  # noqa: E402
import carry_e2e_mamba as mamba  # noqa: E402

# The e2e model's GDN shapes, smaller in the dimensions the loops walk: H q/k heads, HV value heads.
H, HV, K, V = 2, 4, 16, 8
# float32 inputs: the chunked form reassociates the recurrence's sums (a triangular solve, chunk
# products), so float32 results agree with the token-by-token recurrence to about 1e-6 relative,
# never bit for bit; 2e-5 absolute on values of order 1 leaves room for 150-token sequences.
ATOL = 2e-5


def sglang_module(name: str) -> Any:
    importlib.import_module("upstream.conftest")  # puts the sglang tree on sys.path
    return importlib.import_module(name)


def inputs(tokens: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "q": randn(1, tokens, H, K).to(dtype),
        "k": randn(1, tokens, H, K).to(dtype),
        "v": randn(1, tokens, HV, V).to(dtype),
        "a": randn(tokens, HV).to(dtype),
        "b": randn(tokens, HV).to(dtype),
        "A_log": randn(HV) * 0.5,
        "dt_bias": randn(HV) * 0.5,
        "pool": randn(6, HV, V, K) * 0.3,  # [slot, HV, V, K], float32 as sglang's default ssm dtype
    }


# --------------------------------------------------------------------------------------------
# Naive loops, written from the kernels' text
# --------------------------------------------------------------------------------------------
def naive_softplus(x: float, beta: float = 1.0, threshold: float = 20.0) -> float:
    return (1 / beta) * math.log(1 + math.exp(beta * x)) if beta * x <= threshold else x


def naive_gates(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[Any, Any]:
    """fused_gdn_gating_kernel, one (token, head) at a time, in double precision (then compared
    with float32 within float32's rounding)."""
    g = torch.zeros(a.shape, dtype=torch.float64)
    beta = torch.zeros(a.shape, dtype=torch.float64)
    for t in range(a.shape[0]):
        for h in range(a.shape[1]):
            x = float(a[t, h].float()) + float(dt_bias[h].float())
            g[t, h] = -math.exp(float(A_log[h])) * naive_softplus(x)
            beta[t, h] = 1 / (1 + math.exp(-float(b[t, h].float())))
    return g, beta


def naive_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: list[int],
    slots: list[int],
    pool: torch.Tensor,
    l2norm: bool,
) -> torch.Tensor:
    """fused_sigmoid_gating_delta_rule_update_kernel's loop, per sequence, per value head, per token,
    in float64 with the gates given (g, beta (T, HV)): h[k, v] starts at pool[slot, hv].T; h *= exp(g);
    v -= h^T k; v *= beta; h += k v^T; o = h^T (scale q). Updates `pool` in place."""
    out = torch.zeros(q.shape[1], v.shape[2], v.shape[3], dtype=torch.float64)
    group = v.shape[2] // q.shape[2]
    scale = q.shape[-1] ** -0.5
    for n in range(len(starts) - 1):
        for hv in range(v.shape[2]):
            slot = slots[n]
            h = (
                pool[slot, hv].double().T.clone()
                if slot >= 0
                else torch.zeros(k.shape[-1], v.shape[-1]).double()
            )
            for t in range(starts[n], starts[n + 1]):
                bq, bk = q[0, t, hv // group].double(), k[0, t, hv // group].double()
                bv = v[0, t, hv].double()
                if l2norm:
                    bq = bq / math.sqrt(float((bq * bq).sum()) + 1e-6)
                    bk = bk / math.sqrt(float((bk * bk).sum()) + 1e-6)
                h = h * math.exp(float(g[t, hv]))
                bv = (bv - h.T @ bk) * float(beta[t, hv])
                h = h + torch.outer(bk, bv)
                out[t, hv] = h.T @ (bq * scale)
            if slot >= 0:
                pool[slot, hv] = h.T.to(pool.dtype)
    return out


def l2normed(x: torch.Tensor) -> torch.Tensor:
    """l2norm_fwd: float32, written back in x's dtype (the chunked kernels read that)."""
    return gdn._l2norm(x).to(x.dtype)


# --------------------------------------------------------------------------------------------
# The gates
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_equal_the_kernel_formula(dtype: torch.dtype) -> None:
    x = inputs(9, dtype)
    x["a"][0, 0] = 30.0  # past softplus' threshold: x itself
    g, beta = gdn.fused_gdn_gating(x["A_log"], x["a"], x["b"], x["dt_bias"])
    assert g.shape == beta.shape == (1, 9, HV) and g.dtype == beta.dtype == torch.float32
    expected_g, expected_beta = naive_gates(x["A_log"], x["a"], x["b"], x["dt_bias"])
    # float32 against float64: one rounding of exp/log each, 1e-6 relative.
    assert torch.allclose(g[0].double(), expected_g, rtol=1e-6, atol=0)
    assert torch.allclose(beta[0].double(), expected_beta, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------
# The decode step (the recurrence) and the chunked prefill
# --------------------------------------------------------------------------------------------
def test_decode_equals_the_naive_recurrence() -> None:
    x = inputs(7)
    starts, slots = [0, 1, 1, 4, 7], [2, 5, -1, 0]  # one token, an empty one, a padded row, three
    ours, expected_pool = x["pool"].clone(), x["pool"].clone()
    out = gdn.fused_sigmoid_gating_delta_rule_update(
        x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"],
        initial_state_source=ours, initial_state_indices=torch.tensor(slots),
        cu_seqlens=torch.tensor(starts), use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    g, beta = naive_gates(x["A_log"], x["a"], x["b"], x["dt_bias"])
    expected = naive_recurrence(x["q"], x["k"], x["v"], g, beta, starts, slots, expected_pool, l2norm=True)
    assert out.shape == (1, 7, HV, V) and out.dtype == torch.float32
    rows = torch.tensor([t not in range(1, 4) for t in range(7)])  # the padded row's tokens: unwritten
    assert torch.allclose(out[0, rows].double(), expected[rows], atol=ATOL, rtol=0)
    assert torch.allclose(ours, expected_pool, atol=ATOL, rtol=0)
    untouched = [1, 3, 4]  # slots no sequence names, and the padded row's (-1) read and wrote nothing
    assert torch.equal(ours[untouched], x["pool"][untouched])


@pytest.mark.parametrize("lengths", [[150], [5, 64, 130, 1]], ids=["one-sequence", "varlen"])
def test_chunked_prefill_equals_the_naive_recurrence(lengths: list[int]) -> None:
    tokens = sum(lengths)
    x = inputs(tokens, seed=len(lengths))
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    slots = [4, 1, 0, 5][: len(lengths)]
    g, beta = gdn.fused_gdn_gating(x["A_log"], x["a"], x["b"], x["dt_bias"])
    ours, expected_pool = x["pool"].clone(), x["pool"].clone()
    out, final, chunks = gdn.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], g, beta, initial_state=ours, initial_state_indices=torch.tensor(slots),
        cu_seqlens=torch.tensor(starts), head_first=False, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert final is None and chunks is None and out.shape == (1, tokens, HV, V)
    expected = naive_recurrence(
        l2normed(x["q"]), l2normed(x["k"]), x["v"], g[0], beta[0], starts, slots, expected_pool, l2norm=False
    )
    assert torch.allclose(out[0].double(), expected, atol=ATOL, rtol=0)
    assert torch.allclose(ours, expected_pool, atol=ATOL, rtol=0)


def prefill(x: dict[str, torch.Tensor], part: slice, pool: torch.Tensor, slot: int) -> torch.Tensor:
    g, beta = gdn.fused_gdn_gating(x["A_log"], x["a"][part], x["b"][part], x["dt_bias"])
    length = len(range(*part.indices(x["a"].shape[0])))
    out, _, _ = gdn.chunk_gated_delta_rule(
        x["q"][:, part], x["k"][:, part], x["v"][:, part], g, beta, initial_state=pool,
        initial_state_indices=torch.tensor([slot]), cu_seqlens=torch.tensor([0, length]),
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("split", [64, 70, 1])
def test_a_prefill_in_two_parts_equals_the_whole(split: int) -> None:
    """The prefix's state carried in the pool (float32), as a cached prefix's state is. Split at a
    chunk boundary (64) the two runs do the same arithmetic: equal bit for bit. Elsewhere the
    chunks differ: equal within float32 rounding (ATOL)."""
    x = inputs(150, seed=9)
    whole_pool, parts_pool = x["pool"].clone(), x["pool"].clone()
    whole = prefill(x, slice(0, 150), whole_pool, 3)
    first = prefill(x, slice(0, split), parts_pool, 3)
    second = prefill(x, slice(split, 150), parts_pool, 3)
    parts = torch.cat([first, second], dim=1)
    if split % gdn.CHUNK_SIZE == 0:
        assert torch.equal(parts, whole) and torch.equal(parts_pool, whole_pool)
    else:
        assert torch.allclose(parts, whole, atol=ATOL, rtol=0)
        assert torch.allclose(parts_pool, whole_pool, atol=ATOL, rtol=0)
        assert not torch.equal(parts, whole)  # the split did change the arithmetic (a real check)


def test_decode_steps_after_a_prefill_equal_the_naive_recurrence() -> None:
    x = inputs(80, seed=5)
    pool, expected_pool = x["pool"].clone(), x["pool"].clone()
    prefilled = prefill(x, slice(0, 75), pool, 2)
    steps = []
    for t in range(75, 80):
        steps.append(
            gdn.fused_sigmoid_gating_delta_rule_update(
                x["A_log"], x["dt_bias"], x["q"][:, t : t + 1], x["k"][:, t : t + 1], x["v"][:, t : t + 1],
                x["a"][t : t + 1], x["b"][t : t + 1], initial_state_source=pool,
                initial_state_indices=torch.tensor([2]), cu_seqlens=torch.tensor([0, 1]),
                use_qk_l2norm_in_kernel=True,
            )
        )  # fmt: skip
    g, beta = naive_gates(x["A_log"], x["a"], x["b"], x["dt_bias"])
    # The prefill reads q, k L2-normalised then rounded to their dtype (float32 here: no rounding).
    expected = naive_recurrence(x["q"], x["k"], x["v"], g, beta, [0, 80], [2], expected_pool, l2norm=True)
    out = torch.cat([prefilled, *steps], dim=1)[0]
    assert torch.allclose(out.double(), expected, atol=ATOL, rtol=0)
    assert torch.allclose(pool, expected_pool, atol=ATOL, rtol=0)


def test_bf16_outputs_are_rounded_from_float32() -> None:
    """bf16 q, k, v (the model's): outputs in bf16, states in the pool's float32; the chunked and the
    recurrent forms then agree within one bf16 rounding of the output."""
    x = inputs(100, torch.bfloat16, seed=11)
    g, beta = gdn.fused_gdn_gating(x["A_log"], x["a"], x["b"], x["dt_bias"])
    pool, decoded_pool = x["pool"].clone(), x["pool"].clone()
    out, _, _ = gdn.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], g, beta, initial_state=pool, initial_state_indices=torch.tensor([1]),
        cu_seqlens=torch.tensor([0, 100]), use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    decoded = gdn.fused_sigmoid_gating_delta_rule_update(
        x["A_log"], x["dt_bias"], l2normed(x["q"]), l2normed(x["k"]), x["v"], x["a"], x["b"],
        initial_state_source=decoded_pool, initial_state_indices=torch.tensor([1]),
        cu_seqlens=torch.tensor([0, 100]),
    )  # fmt: skip
    assert out.dtype == decoded.dtype == torch.bfloat16 and pool.dtype == torch.float32
    ulp = out.float().abs().clamp(min=1e-3) * 2**-8  # one bf16 step at each value
    assert bool(((out.float() - decoded.float()).abs() <= ulp).all())
    assert torch.allclose(pool, decoded_pool, atol=ATOL, rtol=0)


def test_options_of_other_paths_raise() -> None:
    x = inputs(3)
    g, beta = gdn.fused_gdn_gating(x["A_log"], x["a"], x["b"], x["dt_bias"])
    common: dict[str, Any] = {"initial_state": x["pool"], "initial_state_indices": torch.tensor([0])}
    with pytest.raises(NotImplementedError, match="inplace_update"):
        gdn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, inplace_update=False, **common)
    with pytest.raises(NotImplementedError, match="head-first"):
        gdn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, head_first=True, **common)
    decode = (x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], x["pool"], torch.tensor([0]))
    for option in ({"is_kda": True}, {"disable_state_update": True}, {"retrieve_parent_token": x["a"]}):
        with pytest.raises(NotImplementedError):
            gdn.fused_sigmoid_gating_delta_rule_update(*decode, **option)
    with pytest.raises(IndexError):
        gdn.fused_sigmoid_gating_delta_rule_update(*decode[:-1], torch.tensor([6]))


# --------------------------------------------------------------------------------------------
# The model's small fused ops
# --------------------------------------------------------------------------------------------
def naive_gemma_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """_fused_qk_gemma_rmsnorm_kernel, one row at a time: float32, x * rsqrt(sum(x^2)/D + eps) * (w + 1)."""
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        r = x[row].float()
        out[row] = (r * torch.rsqrt((r * r).sum() / x.shape[1] + eps) * (weight.float() + 1.0)).to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_gemma_norms_equal_the_kernel_row_by_row(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q_gate, k = qkv[:, : 2 * heads * dim], qkv[:, 2 * heads * dim : (2 * heads + kv_heads) * dim]  # views
    qw, kw = torch.randn(dim, generator=generator), torch.randn(dim, generator=generator)
    q, k_out, gate = gdn.fused_qk_gemma_rmsnorm_with_gate(q_gate, k, qw, kw, 1e-6, dim, heads)
    per_head = q_gate.reshape(tokens, heads, 2, dim)
    assert torch.equal(q, naive_gemma_rows(per_head[:, :, 0].reshape(-1, dim), qw, 1e-6))
    assert torch.equal(k_out, naive_gemma_rows(k.reshape(-1, dim), kw, 1e-6))
    assert torch.equal(gate, per_head[:, :, 1].reshape(-1, dim)) and gate.is_contiguous()
    plain_q = q_gate[:, : heads * dim]
    q2, k2 = gdn.fused_qk_gemma_rmsnorm(plain_q, k, qw, kw, 1e-6, dim)
    assert torch.equal(q2, naive_gemma_rows(plain_q.reshape(-1, dim), qw, 1e-6))
    assert torch.equal(k2, k_out)


def test_qkvzba_split_is_the_contiguous_kernels_copy() -> None:
    nqk, nv, dqk, dv, tokens = 2, 4, 3, 5, 3
    qkvz = torch.arange(tokens * (2 * nqk * dqk + 2 * nv * dv), dtype=torch.float32).reshape(tokens, -1)
    ba = -torch.arange(tokens * 2 * nv, dtype=torch.float32).reshape(tokens, -1)
    mixed, z, b, a = gdn.fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, nqk, nv, dqk, dv)
    per_group = nv // nqk
    for t in range(tokens):  # the kernel's program (token, q/k head group) at a time
        for i in range(nqk):
            assert torch.equal(mixed[t, i * dqk : (i + 1) * dqk], qkvz[t, i * dqk : (i + 1) * dqk])
            k_at = nqk * dqk + i * dqk
            assert torch.equal(mixed[t, k_at : k_at + dqk], qkvz[t, k_at : k_at + dqk])
            v_in = 2 * nqk * dqk + i * per_group * dv
            block = qkvz[t, v_in : v_in + per_group * dv]
            assert torch.equal(mixed[t, v_in : v_in + per_group * dv], block)
            z_in = v_in + nv * dv
            assert torch.equal(
                z[t, i * per_group : (i + 1) * per_group].reshape(-1), qkvz[t, z_in : z_in + per_group * dv]
            )
        assert torch.equal(b[t], ba[t, :nv]) and torch.equal(a[t], ba[t, nv:])
    with pytest.raises(ValueError):
        gdn.fused_qkvzba_split_reshape_cat_contiguous(qkvz[:, 1:], ba, nqk, nv, dqk, dv)


def test_sigmoid_mul_is_in_place_and_rounds_once() -> None:
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(4, 12, generator=generator).to(torch.bfloat16)
    gate = torch.randn(4, 12, generator=generator).to(torch.bfloat16)
    expected = x.clone()
    for i in range(4):
        for j in range(12):
            expected[i, j] = (x[i, j].float() * torch.sigmoid(gate[i, j].float())).to(torch.bfloat16)
    gdn.fused_sigmoid_mul(x, gate)
    assert torch.equal(x, expected)


@pytest.mark.parametrize(
    ("group_size", "norm_before_gate", "z_3d"), [(None, True, False), (None, True, True), (4, False, False)]
)
def test_gated_norm_equals_sglangs_torch_reference(
    group_size: int | None, norm_before_gate: bool, z_3d: bool
) -> None:
    """fla/layernorm_gated.py's own torch reference, rms_norm_ref (float32, silu gate): the same
    arithmetic up to the order of one row's sum of squares (1e-6 relative in float32)."""
    reference = sglang_module("sglang.kernels.ops.attention.fla.layernorm_gated").rms_norm_ref
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(12, 16, generator=generator)
    z = torch.randn(12, 16, generator=generator)
    weight = torch.randn(16, generator=generator)
    y, mean, rstd = gdn.layer_norm_fwd(
        x, weight, None, 1e-6, z=z.reshape(3, 4, 16) if z_3d else z, group_size=group_size,
        norm_before_gate=norm_before_gate, is_rms_norm=True,
    )  # fmt: skip
    expected = reference(
        x, weight, None, z=z, eps=1e-6, group_size=group_size, norm_before_gate=norm_before_gate
    )
    assert mean is None and rstd.shape == (16 // (group_size or 16), 12)
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError):
        gdn.layer_norm_fwd(x, weight, None, 1e-6, z=z, quant_heads=4)


# --------------------------------------------------------------------------------------------
# The real Triton kernels' text, run by Triton's interpreter on this CPU, in a child process
# (TRITON_INTERPRET must be set before triton is imported), float32 where the kernel takes it (the
# interpreter's bf16 is broken: test_e2e_mamba.py). Not here: the gated norm, whose launcher enters
# a CUDA device context even when interpreted (checked against sglang's torch reference above).
# --------------------------------------------------------------------------------------------
INTERPRETED = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import torch
    import carry_e2e_gdn as gdn
    from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update)
    from sglang.kernels.ops.attention.triton_gdn_fused_proj import (
        fused_qkvzba_split_reshape_cat_contiguous)
    from sglang.srt.models.utils import fused_qk_gemma_rmsnorm_with_gate
    from sglang.kernels.ops.elementwise.elementwise import fused_sigmoid_mul

    def close(a, b, what, atol):
        error = (a.float() - b.float()).abs().max().item()
        assert error <= atol, (what, error)

    g = torch.Generator().manual_seed(0)
    H, HV, K, V, T = 2, 4, 16, 16, 6
    A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g) * 0.5
    a, b = torch.randn(T, HV, generator=g), torch.randn(T, HV, generator=g)
    for ours, theirs, what in zip(gdn.fused_gdn_gating(A_log, a, b, dt_bias),
                                  fused_gdn_gating(A_log, a, b, dt_bias), ("g", "beta")):
        close(ours, theirs, what, 1e-6)

    q, k = torch.randn(1, T, H, K, generator=g), torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, HV, V, generator=g)
    pool = torch.randn(5, HV, V, K, generator=g) * 0.3
    kwargs = dict(initial_state_indices=torch.tensor([3, -1, 0]), cu_seqlens=torch.tensor([0, 1, 2, 6]),
                  use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
    ours_pool, theirs_pool = pool.clone(), pool.clone()
    ours = gdn.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b,
                                                      initial_state_source=ours_pool, **kwargs)
    theirs = fused_sigmoid_gating_delta_rule_update(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b,
                                                    initial_state_source=theirs_pool, **kwargs)
    rows = torch.tensor([True, False, True, True, True, True])  # the padded row: never written
    close(ours[0, rows], theirs[0, rows], "decode", 1e-5)
    close(ours_pool, theirs_pool, "decode state", 1e-5)

    qkvz, ba = torch.randn(3, 2 * H * K + 2 * HV * V, generator=g), torch.randn(3, 2 * HV, generator=g)
    for ours, theirs in zip(gdn.fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, H, HV, K, V),
                            fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, H, HV, K, V)):
        assert torch.equal(ours, theirs), "split"

    qg = torch.randn(3, 2 * 4 * 16, generator=g).half()
    kk = torch.randn(3, 2 * 16, generator=g).half()
    qw, kw = torch.randn(16, generator=g), torch.randn(16, generator=g)
    for ours, theirs in zip(gdn.fused_qk_gemma_rmsnorm_with_gate(qg, kk, qw, kw, 1e-6, 16, 4),
                            fused_qk_gemma_rmsnorm_with_gate(qg, kk, qw, kw, 1e-6, 16, 4)):
        close(ours, theirs, "qk gemma norm (fp16)", 1e-3)

    attn, gate = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    ours = attn.clone()
    gdn.fused_sigmoid_mul(ours, gate)
    close(ours, fused_sigmoid_mul(attn.clone(), gate), "sigmoid mul", 1e-6)
    print("interpreted kernels agree")
    """
)


def test_standins_equal_the_triton_kernels_run_by_the_interpreter() -> None:
    """Tolerances: float32 reductions in another order (1e-5 for the recurrence over 4 tokens, 1e-6
    for elementwise ops whose exp may round differently); fp16 outputs within one fp16 step (1e-3)."""
    pytest.importorskip("triton")
    tree = sglang_module("upstream.conftest").upstream_tree("sglang")
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED, str(tree), str(CPU)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0 and "interpreted kernels agree" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# The Mamba copy kernels with this model's state: conv (bf16) and the delta rule's matrix (float32)
# --------------------------------------------------------------------------------------------
def test_gdn_state_round_trip_through_sglangs_host_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    pool_host = sglang_module("sglang.srt.mem_cache.pool_host.mamba")
    info_class = sglang_module("sglang.srt.mem_cache.device_pool_info").MambaStateBufferInfo
    for name, kernel in mamba.COPY_KERNELS.items():
        monkeypatch.setattr(pool_host, name, kernel, raising=False)  # bound only on CUDA/HIP there
    layers, slots = 3, 6  # the e2e model's three GDN layers
    generator = torch.Generator().manual_seed(12)
    # (HV, V, K) float32 and the conv state (2 key_dim + value_dim, kernel - 1) in bf16, as configured
    temporal = torch.randn(layers, slots + 1, 4, 64, 64, generator=generator)
    conv = torch.randn(layers, slots + 1, 512, 3, generator=generator).to(torch.bfloat16)
    host = pool_host.MambaPoolHost(
        info_class(temporal=temporal, conv=(conv,)), 2.0, 0, device_capacity=slots,
        pin_memory=False, device="cpu", layout="page_first",
    )  # fmt: skip
    host_slots, device_slots = host.alloc(2), torch.tensor([5, 2])
    host.backup_from_device_all_layer(None, host_slots, device_slots, io_backend="kernel")
    saved = temporal[:, device_slots].clone(), conv[:, device_slots].clone()
    assert torch.count_nonzero(saved[0]) == saved[0].numel()  # a non-empty temporal state travels
    temporal.zero_()
    conv.zero_()
    targets = torch.tensor([1, 6])
    for layer in range(layers):
        host.load_to_device_per_layer(None, host_slots, targets, layer, io_backend="kernel")
    assert torch.equal(temporal[:, targets], saved[0]) and torch.equal(conv[:, targets], saved[1])
    others = [s for s in range(slots + 1) if s not in targets.tolist()]
    assert torch.count_nonzero(temporal[:, others]) == 0 and torch.count_nonzero(conv[:, others]) == 0


# --------------------------------------------------------------------------------------------
# Installation, and the names sglang's CPU code takes
# --------------------------------------------------------------------------------------------
def test_install_binds_every_name_and_raises_for_the_rest() -> None:
    parent, ops = ModuleType("sgl_kernel"), SimpleNamespace()
    modules: dict[str, ModuleType] = {"sgl_kernel": parent}
    gdn.install(modules, ops)
    mamba.install_import_time_names(modules, ops)  # the hook's order: it keeps what gdn bound
    submodule = modules[mamba.MAMBA_SUBMODULE]
    assert vars(parent)["mamba"] is submodule
    for name, function in gdn.MAMBA_SUBMODULE_FUNCTIONS.items():
        assert getattr(submodule, name) is function
    for name, function in gdn.TORCH_OPS.items():
        assert getattr(ops, name) is function
    for name in gdn.TORCH_OPS_NOT_HERE:
        with pytest.raises(NotImplementedError, match=name):
            getattr(ops, name)()
    assert not hasattr(ops, "convert_weight_packed")  # sglang's AMX check stays False


def test_importing_the_standins_installs_nothing() -> None:
    assert mamba.MAMBA_SUBMODULE not in sys.modules
    assert not any(hasattr(torch.ops.sgl_kernel, name) for name in gdn.TORCH_OPS)


def cpu_bound_names(source: str) -> tuple[set[str], set[str]]:
    """The sgl_kernel.mamba imports and torch.ops.sgl_kernel attributes of a module's text."""
    imported: set[str] = set()
    ops: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == mamba.MAMBA_SUBMODULE:
            imported |= {alias.name for alias in node.names}
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.ops.sgl_kernel":
            ops.add(node.attr)
    return imported, ops


def test_the_names_are_those_the_gdn_model_and_backend_take_on_cpu() -> None:
    tree = sglang_module("upstream.conftest").upstream_tree("sglang") / "sglang/srt"
    imported: set[str] = set()
    ops: set[str] = set()
    for path in (
        "models/qwen3_5.py",
        "layers/attention/linear/gdn_backend.py",
        "layers/attention/linear/kernels/gdn_triton.py",
    ):
        more_imported, more_ops = cpu_bound_names((tree / path).read_text())
        imported, ops = imported | more_imported, ops | more_ops
    assert imported == set(gdn.MAMBA_SUBMODULE_FUNCTIONS)
    assert ops == set(gdn.TORCH_OPS) | set(gdn.TORCH_OPS_NOT_HERE)
    norm = (tree.parent / "kernels/ops/attention/fla/layernorm_gated.py").read_text()
    assert "    y, mean, rstd = _layer_norm_fwd(\n" in norm  # rms_norm_gated reads the patched global


def test_the_gated_norm_patch_leaves_amx_alone() -> None:
    module = SimpleNamespace(_use_cpu=False, _layer_norm_fwd=None)
    gdn.patch_gated_norm(module)
    assert module._layer_norm_fwd is gdn.layer_norm_fwd
    amx = SimpleNamespace(_use_cpu=True, _layer_norm_fwd=None)
    gdn.patch_gated_norm(amx)
    assert amx._layer_norm_fwd is None
