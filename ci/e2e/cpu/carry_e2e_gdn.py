"""Stand-ins for what a gated-delta-net (GDN) hybrid, Qwen3.5's text model (`Qwen3_5ForCausalLM`:
GDN layers + gated full-attention layers), needs from the kernel boundary when a real sglang 0.5.23
server serves it on CPU with native HiCache (e2e only).

Loaded beside carry_e2e_mamba (whose conv stand-ins, Mamba copy kernels and late-copy count the GDN
runs use as they are) only into the e2e's GDN server processes (CARRY_E2E_GDN=1); never in a
unit-test environment or a built wheel. On CPU sglang binds these names to its CPU build of
sgl_kernel, which is not on PyPI: `sgl_kernel.mamba` (layers/attention/linear/gdn_backend.py:183-188,
layers/attention/linear/kernels/gdn_triton.py:27-33) and `torch.ops.sgl_kernel` attributes
(models/qwen3_5.py:283-298, gdn_backend.py:188, gdn_triton.py:31-33). Each is plain torch written
from the Triton kernel the GPU runs for the same call, with the same layouts:

- `chunk_gated_delta_rule_cpu`: the chunked gated delta rule of a prefill (kernels/ops/attention/
  fla/chunk.py: chunk-local cumsum of g, the WY form inside a chunk, the state carried from chunk to
  chunk), in float32, q and k L2-normalised and rounded to their dtype first as `l2norm_fwd` does;
  the final state written in place into the state pool (`initial_state[initial_state_indices]`, a
  -1 index neither read nor written). The Triton kernels round w, u and v_new to bf16 between their
  stages; this keeps float32, so it equals them up to that rounding, and equals the token-by-token
  recurrence up to float32 rounding (the tests state the tolerance).
- `fused_sigmoid_gating_delta_rule_update_cpu`: a decode step (kernels/ops/attention/linear/
  fused_sigmoid_gating_recurrent.py): gates from A_log, a, dt_bias and b, then per token
  h *= exp(g); v -= h k; v *= beta; h += k v; o = h q, in float32 in the kernel's order.
- `fused_gdn_gating_cpu` (kernels/ops/attention/linear/fused_gdn_gating.py): g and beta in float32.
- the gated RMSNorm after the GDN core (fla/layernorm_gated.py `_layer_norm_fwd`, Triton on every
  CPU without AMX), patched in its module;
- `fused_qk_gemma_rmsnorm_cpu`, `fused_qk_gemma_rmsnorm_with_gate_cpu` (models/utils.py's Triton
  kernels), `fused_qkvzba_split_reshape_cat_contiguous_cpu` (kernels/ops/attention/
  triton_gdn_fused_proj.py: a copy into the [q|k|v], z, b, a layout) and `fused_sigmoid_mul_cpu`
  (kernels/ops/elementwise/elementwise.py, in place);
- `causal_conv1d_fn_cpu` / `causal_conv1d_update_cpu`: carry_e2e_mamba's stand-ins (the GDN
  backend calls them with the Triton wrappers' arguments).

Not implemented, raising if called: `fused_input_proj_cpu` (reached only with AMX weights, which
the stand-ins never enable: `convert_weight_packed` stays undefined), target verify, KDA, ReplaySSM
and multi-item scoring options.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
from collections.abc import Callable, MutableMapping
from types import ModuleType
from typing import Any

import carry_e2e_mamba
import torch

CHUNK_SIZE = 64  # fla/chunk.py's CHUNK_SIZE: the chunks the Triton prefill works in
L2NORM_EPS = 1e-6  # l2norm_fwd's default, and the decode kernel's


# --------------------------------------------------------------------------------------------
# The gates (fused_gdn_gating.py): g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
# --------------------------------------------------------------------------------------------
def _softplus(x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    """The kernels' softplus: (1/beta) log(1 + exp(beta x)) where beta x <= threshold, else x."""
    return torch.where(beta * x <= threshold, (1 / beta) * torch.log(1 + torch.exp(beta * x)), x)


def _decay(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, beta: float, threshold: float
) -> torch.Tensor:
    return -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float(), beta, threshold)


def fused_gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b (tokens, heads) -> g, beta, each (1, tokens, heads) float32, as the Triton kernel's
    (its beta output is allocated float32, so the bf16 cast it names is a no-op)."""
    if a.dim() != 2 or b.shape != a.shape:
        raise NotImplementedError(
            f"carry-e2e-gdn: fused_gdn_gating takes a, b as (tokens, heads), got {a.shape}"
        )
    g = _decay(A_log, a, dt_bias, beta, threshold)
    return g.unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0)


# --------------------------------------------------------------------------------------------
# The gated delta rule. State layout of the pool: [slot, HV, V, K] (the kernels' h0 + idx * stride
# + hv * K * V + v * K + k); q and k have H heads, v has HV, head hv reads q/k head hv // (HV / H).
# --------------------------------------------------------------------------------------------
def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return x32 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) + L2NORM_EPS)


def _heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """q/k (tokens, H, K) repeated to the value heads (tokens, HV, K): head hv reads hv // (HV/H)."""
    return x.repeat_interleave(value_heads // x.shape[1], dim=1)


def _state_slot(indices: torch.Tensor | None, sequence: int, slots: int) -> int | None:
    slot = sequence if indices is None else int(indices[sequence])
    if slot < 0:  # padded rows carry -1: the kernels neither read nor write a state for them
        return None
    if slot >= slots:
        raise IndexError(f"carry-e2e-gdn: state slot {slot} outside the {slots} of the pool")
    return slot


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C tokens, all heads at once, float32: q, k (HV, C, K) (q scaled), v (HV, C, V),
    g (HV, C) the chunk-local cumsum of the log decays, beta (HV, C), state (HV, V, K) at the chunk's
    start. The WY form (fla/chunk.py): A = strictly lower beta_i k_i.k_j exp(g_i - g_j);
    T = (I + A)^-1; w = T (beta exp(g) k); u = T (beta v); v_new = u - w S^T;
    o = exp(g) q S^T + (causal q k^T exp(g_i - g_j)) v_new; S' = exp(g_C) S + (exp(g_C - g) v_new)^T k."""
    length = q.shape[1]
    lower = torch.ones(length, length, dtype=torch.bool).tril(-1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    decay = (g[:, :, None] - g[:, None, :]).masked_fill(~causal, -math.inf).exp()  # (HV, C, C)
    kk = (k @ k.transpose(1, 2)) * decay * beta[:, :, None]
    eye = torch.eye(length).expand_as(kk)
    solve = torch.linalg.solve_triangular(eye + kk.masked_fill(~lower, 0.0), eye, upper=False)
    w = solve @ (k * (beta * g.exp())[:, :, None])
    u = solve @ (v * beta[:, :, None])
    v_new = u - w @ state.transpose(1, 2)
    attention = (q @ k.transpose(1, 2)) * decay
    out = (q * g.exp()[:, :, None]) @ state.transpose(1, 2) + attention @ v_new
    last = g[:, -1]
    carried = (v_new * (last[:, None] - g).exp()[:, :, None]).transpose(1, 2) @ k
    return out, state * last.exp()[:, None, None] + carried


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None, None]:
    """Prefill, varlen (fla/chunk.py's chunk_gated_delta_rule as gdn_triton.py calls it on CPU):
    q, k (1, T, H, K), v (1, T, HV, V), g, beta (1, T, HV); sequence s at [cu_seqlens[s],
    cu_seqlens[s+1]) starts from initial_state[initial_state_indices[s]], which receives its final
    state. Returns (o (1, T, HV, V) in q's dtype, None, None): the per-chunk states (the third item)
    are read only by extra_buffer's state tracking, which CPU does not run (the platform refuses it)."""
    if kwargs.pop("inplace_update", True) is not True:
        raise NotImplementedError(
            "carry-e2e-gdn: chunk_gated_delta_rule(inplace_update=False) (multi-item scoring)"
        )
    if kwargs:
        raise NotImplementedError(f"carry-e2e-gdn: chunk_gated_delta_rule options {sorted(kwargs)}")
    if head_first or q.dim() != 4 or q.shape[0] != 1:
        raise NotImplementedError(
            "carry-e2e-gdn: chunk_gated_delta_rule takes (1, T, heads, dim), not head-first"
        )
    if initial_state is None:
        raise NotImplementedError(
            "carry-e2e-gdn: chunk_gated_delta_rule needs the state pool (initial_state)"
        )
    tokens, value_heads = v.shape[1], v.shape[2]
    starts = [0, tokens] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    # l2norm_fwd writes its result in the input's dtype: the chunked kernels read rounded q and k.
    qn = _l2norm(q[0]).to(q.dtype).float() if use_qk_l2norm_in_kernel else q[0].float()
    kn = _l2norm(k[0]).to(k.dtype).float() if use_qk_l2norm_in_kernel else k[0].float()
    qh = _heads(qn, value_heads).transpose(0, 1) * scale  # (HV, T, K)
    kh = _heads(kn, value_heads).transpose(0, 1)
    vh = v[0].float().transpose(0, 1)  # (HV, T, V)
    gh, bh = g[0].float().transpose(0, 1), beta[0].float().transpose(0, 1)  # (HV, T)
    out = torch.zeros(value_heads, tokens, v.shape[-1], dtype=torch.float32)
    for sequence, (start, end) in enumerate(itertools.pairwise(starts)):
        slot = _state_slot(initial_state_indices, sequence, initial_state.shape[0])
        state = (
            initial_state[slot].float()
            if slot is not None
            else torch.zeros(value_heads, v.shape[-1], k.shape[-1], dtype=torch.float32)
        )
        for at in range(start, end, CHUNK_SIZE):
            part = slice(at, min(at + CHUNK_SIZE, end))
            cumulative = gh[:, part].cumsum(-1)  # chunk_local_cumsum: restarts at every chunk
            out[:, part], state = _chunk(
                qh[:, part], kh[:, part], vh[:, part], cumulative, bh[:, part], state
            )
        if slot is not None:
            initial_state[slot] = state.to(initial_state.dtype)
    return out.transpose(0, 1).unsqueeze(0).to(q.dtype), None, None


# Options of the decode kernel that belong to other paths (target verify, KDA, ReplaySSM).
_DECODE_OPTIONS_NOT_HERE = (
    "disable_state_update",
    "intermediate_states_buffer",
    "intermediate_state_indices",
    "cache_steps",
    "retrieve_parent_token",
    "cache_ring",
    "replayssm_rawv",
    "replayssm_rawk",
    "replayssm_g",
    "replayssm_beta",
    "lower_bound",
    "match_cutedsl_decode",
)


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    scale: float | None = None,
    is_kda: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """Decode (gdn_triton.py's decode): q, k (1, T, H, K), v (1, T, HV, V), a, b (T, HV), sequence n
    at [cu_seqlens[n], cu_seqlens[n+1]) from state slot initial_state_indices[n]; every token
    updates the state in float32 in the kernel's order, which is stored back in the pool's dtype.
    Returns o (1, T, HV, V) in q's dtype."""
    options = {name: kwargs.pop(name, None) for name in _DECODE_OPTIONS_NOT_HERE}
    given = sorted(name for name, value in options.items() if value is not None and value is not False)
    if is_kda or given or kwargs:
        raise NotImplementedError(
            f"carry-e2e-gdn: decode options {['is_kda'] * is_kda + given + sorted(kwargs)}"
        )
    if q.dim() != 4 or q.shape[0] != 1:
        raise NotImplementedError("carry-e2e-gdn: the decode stand-in takes (1, T, heads, dim) (varlen) only")
    tokens, value_heads, head_v = v.shape[1], v.shape[2], v.shape[3]
    head_k = k.shape[-1]
    starts = [0, tokens] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    scale = head_k**-0.5 if scale is None else scale
    group = value_heads // k.shape[2]
    out = torch.zeros(tokens, value_heads, head_v, dtype=torch.float32)
    decays = _decay(A_log, a, dt_bias, softplus_beta, softplus_threshold)  # (T, HV)
    betas = 1.0 / (1.0 + torch.exp(-b.float()))
    for sequence, (start, end) in enumerate(itertools.pairwise(starts)):
        slot = _state_slot(initial_state_indices, sequence, initial_state_source.shape[0])
        # The kernel's tile is h[k, v]; the pool stores [v, k]: transposed on the way in and out.
        h = (
            initial_state_source[slot].float().transpose(1, 2)
            if slot is not None
            else torch.zeros(value_heads, head_k, head_v, dtype=torch.float32)
        )
        for t in range(start, end):
            bq = q[0, t].float().repeat_interleave(group, dim=0)  # (HV, K)
            bk = k[0, t].float().repeat_interleave(group, dim=0)
            bv = v[0, t].float()  # (HV, V)
            if use_qk_l2norm_in_kernel:
                bq = bq * (1.0 / torch.sqrt((bq * bq).sum(-1, keepdim=True) + L2NORM_EPS))
                bk = bk * (1.0 / torch.sqrt((bk * bk).sum(-1, keepdim=True) + L2NORM_EPS))
            bq = bq * scale
            h = h * torch.exp(decays[t])[:, None, None]
            bv = (bv - (h * bk[:, :, None]).sum(1)) * betas[t][:, None]
            h = h + bk[:, :, None] * bv[:, None, :]
            out[t] = (h * bq[:, :, None]).sum(1)
        if slot is not None:
            initial_state_source[slot] = h.transpose(1, 2).to(initial_state_source.dtype)
    return out.unsqueeze(0).to(q.dtype)


# --------------------------------------------------------------------------------------------
# The model's small fused ops (models/qwen3_5.py:283-298 binds them to torch.ops.sgl_kernel on CPU)
# --------------------------------------------------------------------------------------------
def fused_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate), in place, in float32 rounded to x's dtype (elementwise.py's kernel)."""
    if gate.shape != x.shape:
        raise NotImplementedError(
            f"carry-e2e-gdn: fused_sigmoid_mul of {tuple(x.shape)} by {tuple(gate.shape)}"
        )
    x.copy_((x.float() * torch.sigmoid(gate.float())).to(x.dtype))


def _gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of x: x * rsqrt(mean(x^2) + eps) * (w + 1), float32, rounded to x's dtype."""
    x32 = x.float()
    variance = (x32 * x32).sum(-1, keepdim=True) / x.shape[-1]
    return (x32 * torch.rsqrt(variance + eps) * (weight.float() + 1.0)).to(x.dtype)


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (tokens, heads * head_dim) -> each (tokens * heads, head_dim), normed per head."""
    return (
        _gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps),
        _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps),
    )


def fused_qk_gemma_rmsnorm_with_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_gate (tokens, heads * 2 * head_dim), per head [q | gate] -> q normed, k normed, gate copied,
    each (rows, head_dim) contiguous."""
    per_head = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim)
    q = per_head[:, :, :head_dim].reshape(-1, head_dim)
    gate = per_head[:, :, head_dim:].reshape(-1, head_dim).clone()
    return _gemma_rmsnorm(q, q_weight, eps), _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps), gate


def fused_qkvzba_split_reshape_cat_contiguous(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[q | k | v | z] and [b | a] per token -> mixed_qkv (tokens, 2 Hqk Dqk + Hv Dv), z (tokens,
    Hv, Dv), b, a (tokens, Hv): copies (triton_gdn_fused_proj.py's contiguous kernel)."""
    qkv = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    if mixed_qkvz.shape[-1] != qkv + num_heads_v * head_v or mixed_ba.shape[-1] != 2 * num_heads_v:
        raise ValueError(f"carry-e2e-gdn: qkvz {tuple(mixed_qkvz.shape)} / ba {tuple(mixed_ba.shape)}")
    tokens = mixed_qkvz.shape[0]
    mixed_qkv = mixed_qkvz[:, :qkv].contiguous()
    z = mixed_qkvz[:, qkv:].reshape(tokens, num_heads_v, head_v).contiguous()
    return mixed_qkv, z, mixed_ba[:, :num_heads_v].contiguous(), mixed_ba[:, num_heads_v:].contiguous()


def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    z: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    is_rms_norm: bool = False,
    activation: str = "swish",
    quant_heads: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fla/layernorm_gated.py's `_layer_norm_fwd` (x (M, N), z (M, N) or (M/heads, heads, N)): per
    group of columns, float32, gate by silu(z) (swish) or sigmoid(z) before or after the norm;
    returns (y in x's dtype, mean (None for RMS), rstd)."""
    if quant_heads:
        raise NotImplementedError("carry-e2e-gdn: the gated norm's FP8 output (quant_heads)")
    if activation not in ("swish", "silu", "sigmoid"):
        raise NotImplementedError(f"carry-e2e-gdn: gated norm activation {activation!r}")
    rows, columns = x.shape
    group = columns if group_size is None else group_size
    x32 = x.float().reshape(rows, columns // group, group)
    gate = None if z is None else z.reshape(rows, columns).float().reshape(rows, columns // group, group)

    def gated(values: torch.Tensor) -> torch.Tensor:
        assert gate is not None
        return values * (gate * torch.sigmoid(gate) if activation != "sigmoid" else torch.sigmoid(gate))

    if gate is not None and not norm_before_gate:
        x32 = gated(x32)
    mean = None if is_rms_norm else x32.mean(-1, keepdim=True)
    centred = x32 if mean is None else x32 - mean
    rstd = torch.rsqrt((centred * centred).sum(-1, keepdim=True) / group + eps)
    y = centred * rstd * weight.float().reshape(columns // group, group)
    if bias is not None:
        y = y + bias.float().reshape(columns // group, group)
    if gate is not None and norm_before_gate:
        y = gated(y)
    result = out if out is not None else torch.empty_like(x)
    result.copy_(y.reshape(rows, columns))
    return result, (None if mean is None else mean.reshape(rows, -1).T.contiguous()), rstd.reshape(rows, -1).T


# --------------------------------------------------------------------------------------------
# Installation: the names sglang binds at import on CPU, and the gated norm's module
# --------------------------------------------------------------------------------------------
MAMBA_SUBMODULE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "causal_conv1d_fn_cpu": carry_e2e_mamba.causal_conv1d_fn,
    "causal_conv1d_update_cpu": carry_e2e_mamba.causal_conv1d_update,
    "chunk_gated_delta_rule_cpu": chunk_gated_delta_rule,
}
TORCH_OPS: dict[str, Callable[..., Any]] = {
    "fused_gdn_gating_cpu": fused_gdn_gating,
    "fused_sigmoid_gating_delta_rule_update_cpu": fused_sigmoid_gating_delta_rule_update,
    "fused_sigmoid_mul_cpu": fused_sigmoid_mul,
    "fused_qk_gemma_rmsnorm_cpu": fused_qk_gemma_rmsnorm,
    "fused_qk_gemma_rmsnorm_with_gate_cpu": fused_qk_gemma_rmsnorm_with_gate,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": fused_qkvzba_split_reshape_cat_contiguous,
}
# Bound by name on CPU, called only where AMX packed the weights (models/qwen3_5.py:437-447, :900).
TORCH_OPS_NOT_HERE = ("fused_input_proj_cpu",)


def install(modules: MutableMapping[str, ModuleType] | None = None, ops: Any = None) -> None:
    """Put the stand-ins where sglang's CPU imports look for them: `sgl_kernel.mamba` (created if
    missing) and torch.ops.sgl_kernel attributes (a registered op of a name stays). Runs before
    carry_e2e_mamba.install_import_time_names, which then leaves these names alone."""
    modules = sys.modules if modules is None else modules
    ops = torch.ops.sgl_kernel if ops is None else ops
    parent = modules["sgl_kernel"] if "sgl_kernel" in modules else importlib.import_module("sgl_kernel")
    submodule = modules.get(carry_e2e_mamba.MAMBA_SUBMODULE)
    if submodule is None:
        submodule = ModuleType(carry_e2e_mamba.MAMBA_SUBMODULE, "The e2e's CPU stand-ins for the GDN model.")
        modules[carry_e2e_mamba.MAMBA_SUBMODULE] = submodule
    vars(parent)["mamba"] = submodule
    for name, function in MAMBA_SUBMODULE_FUNCTIONS.items():
        setattr(submodule, name, function)
    for name, function in TORCH_OPS.items():
        if not hasattr(ops, name):
            setattr(ops, name, function)
    for name in TORCH_OPS_NOT_HERE:
        if not hasattr(ops, name):
            setattr(ops, name, carry_e2e_mamba.NotHere(f"torch.ops.sgl_kernel.{name}"))


GATED_NORM_MODULE = "sglang.kernels.ops.attention.fla.layernorm_gated"


def patch_gated_norm(module: Any) -> None:
    if getattr(module, "_use_cpu", False):  # AMX: sglang calls its own CPU op, not Triton
        return
    module._layer_norm_fwd = layer_norm_fwd  # rms_norm_gated reads the module's global


PATCHES: dict[str, Callable[[Any], None]] = {GATED_NORM_MODULE: patch_gated_norm}
