"""The tiny models the servers load, written here (no download). One row of MODELS per model
family: its config.json, its weights' names and shapes (seeded random safetensors; None: the
server makes them up with --load-format dummy) and the flags its GPU runs add."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

# Every model's vocabulary; the traffic draws its prompts from it.
VOCAB = 1024

DENSE_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
HYBRID_QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A hybrid whose Mamba state is a short convolution's (LFM2: gated short-conv layers and one
# attention layer). Its conv state remembers the last conv_L_cache - 1 tokens of each prefix.
HYBRID_LFM2 = {
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["conv", "conv", "full_attention", "conv"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "conv_L_cache": 3,
    "conv_bias": False,
    "norm_eps": 1e-5,
    "block_auto_adjust_ff_dim": False,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# A gated-delta-net hybrid, Qwen3.5's dense text model (`Qwen3_5ForCausalLM`): GDN layers, whose
# Mamba state is a short conv's plus the delta rule's (HV, V, K) float32 matrix (the temporal
# state), and a gated full-attention layer. sglang takes the layer kinds from
# full_attention_interval (configs/qwen3_next.py:260-269): [GDN, GDN, attention, GDN]; layer_types
# says the same for other readers. Head counts divide by 2, so the CPU head-count rewrite
# (configs/update_config.py:111-142) keeps them at one rank and at two.
HYBRID_GDN: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "full_attention_interval": 3,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    # Qwen3.5's checkpoints name the rope here; without a type sglang refuses an empty rope_scaling.
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def gdn_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF Qwen3.5 text parameter names and shapes for `config` (sglang's load_weights maps
    in_proj_qkv/in_proj_z and in_proj_b/in_proj_a onto its fused projections: qwen3_5.py:1985)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim, heads, kv_heads = (
        config["head_dim"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    key_dim = config["linear_key_head_dim"] * config["linear_num_key_heads"]
    value_dim = config["linear_value_head_dim"] * config["linear_num_value_heads"]
    value_heads = config["linear_num_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if (i + 1) % config["full_attention_interval"] == 0:
            shapes |= {
                p + "self_attn.q_proj.weight": (2 * heads * head_dim, hidden),  # q and its output gate
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
            }
        else:
            shapes |= {
                p + "linear_attn.in_proj_qkv.weight": (2 * key_dim + value_dim, hidden),
                p + "linear_attn.in_proj_z.weight": (value_dim, hidden),
                p + "linear_attn.in_proj_b.weight": (value_heads, hidden),
                p + "linear_attn.in_proj_a.weight": (value_heads, hidden),
                p + "linear_attn.conv1d.weight": (
                    2 * key_dim + value_dim,
                    1,
                    config["linear_conv_kernel_dim"],
                ),
                p + "linear_attn.dt_bias": (value_heads,),
                p + "linear_attn.A_log": (value_heads,),
                p + "linear_attn.norm.weight": (config["linear_value_head_dim"],),
                p + "linear_attn.out_proj.weight": (hidden, value_dim),
            }
    return shapes


def lfm2_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF LFM2 parameter names and shapes for `config` (sglang's load_weights maps them, and
    skips a name it does not know: lfm2.py:751)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.embedding_norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "operator_norm.weight": (hidden,),
            p + "ffn_norm.weight": (hidden,),
            p + "feed_forward.w1.weight": (inter, hidden),
            p + "feed_forward.w3.weight": (inter, hidden),
            p + "feed_forward.w2.weight": (hidden, inter),
        }
        if kind == "full_attention":
            shapes |= {
                p + "self_attn.q_proj.weight": (q, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.out_proj.weight": (hidden, q),
                p + "self_attn.q_layernorm.weight": (head_dim,),
                p + "self_attn.k_layernorm.weight": (head_dim,),
            }
        else:
            shapes |= {
                p + "conv.in_proj.weight": (3 * hidden, hidden),
                p + "conv.out_proj.weight": (hidden, hidden),
                p + "conv.conv.weight": (hidden, 1, config["conv_L_cache"]),
            }
    return shapes


def llama_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names and shapes for `config`."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


WeightShapes = Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]


class Family(NamedTuple):
    """A model family: its config, its weights' names and shapes (None: --load-format dummy), and
    the flags its GPU runs add (a CPU run takes CPU_FLAGS and its scenario's)."""

    config: dict[str, Any]
    weight_shapes: WeightShapes | None
    gpu_flags: list[str]


# The name is what --models takes and what a Scenario's `model` names.
MODELS: dict[str, Family] = {
    "dense": Family(DENSE_LLAMA, llama_weight_shapes, []),
    "hybrid": Family(HYBRID_QWEN3_5, None, ["--load-format", "dummy", "--max-mamba-cache-size", "32"]),
    "lfm2": Family(HYBRID_LFM2, lfm2_weight_shapes, []),
    "gdn": Family(HYBRID_GDN, gdn_weight_shapes, []),
}


def dense_weight(key: str, shape: tuple[int, ...], generator: Any) -> Any:
    """Norms 1, every matrix of std 0.02 (the dense model's weights, unchanged since first written)."""
    import torch

    return (
        torch.ones(shape) if key.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
    )


def initial_weight(key: str, shape: tuple[int, ...], generator: Any) -> Any:
    """Norms 1; a short conv's taps of std 0.6 and every other matrix scaled 1/sqrt(fan_in), so
    every mixer (and so a Mamba state) moves the logits."""
    import torch

    if key.endswith("norm.weight"):
        return torch.ones(shape)
    if key.endswith("conv.conv.weight"):
        return torch.randn(shape, generator=generator) * 0.6
    return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])


def write_models(folder: Path, names: Sequence[str], seed: int = 0) -> dict[str, Path]:
    """One directory per model: config.json, and seeded random safetensors where it has weights."""
    dirs = {}
    for name in names:
        config, weight_shapes, _ = MODELS[name]
        model_dir = folder / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config, indent=2))
        (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
        if weight_shapes is not None:
            import torch
            from safetensors.torch import save_file

            generator = torch.Generator().manual_seed(seed)
            # The dense model keeps the weights it was first written with; every later family
            # takes initial_weight.
            initial = dense_weight if name == "dense" else initial_weight
            tensors = {
                key: initial(key, shape, generator).to(torch.bfloat16)
                for key, shape in weight_shapes(config).items()
            }
            save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        dirs[name] = model_dir
    return dirs
