"""End-to-end: a real sglang server, HiCache on, a KV miss injected while the batch's load is in
flight; on one GPU (default) or on CPU, one rank and two.

    python ci/e2e/run_e2e.py --wheel dist/sglang-<V>+carry.<N>-*.whl --out build/e2e
        [--pristine-wheel upstream/.downloads/sglang-<V>-*.whl] [--models dense,hybrid]
    python ci/e2e/run_e2e.py --device cpu [--upstream V] --out build/e2e-cpu [--runs ...]

GPU (run with the line's GPU environment, ci/gpu-env: the official wheel's requirements with the
patched wheel installed): for each tiny model written here (no download: a dense Llama with
seeded random weights in safetensors, and a hybrid Qwen3.5 (Gated DeltaNet + attention) served
with --load-format dummy), the runs control, pristine and patched.

CPU (`--device cpu`, the dense model only: the hybrid one needs CPU kernels nobody ships): the
line `--upstream V` (default: the newest line with a series) as cpu_line.py prepares it (the
pristine wheel from the pin, the patched wheel built if missing, the series without its load
wait), served by the line's test environment with SGLANG_USE_CPU_ENGINE=1 and the stand-ins of
ci/e2e/cpu/ (sgl_kernel's CPU ops, the two HiCache copy kernels, plain host-pool memory, and
HiCache's copy streams running their copies later on a worker, so a load is really in flight).
The runs (`--runs`, default all of CPU_RUNS the line has): control, pristine, patched,
without-load-wait, and the same first three with --tp-size 2 (tp2-control, tp2-pristine,
tp2-patched), the miss on rank 1 only and the KV pool marked rank-local on every rank, as a
kvcached elastic pool is; and tp2-uneven, tp2-patched with rank 0's free space reported
WITHHELD_TOKENS lower while its scheduler is busy, so the ranks admit differently; tp2-drift,
as tp2-uneven with the withheld amount changing at every reading (as kvcached's TTL-cached
physical reading drifts); tp2-delayer, as tp2-uneven with --enable-prefill-delayer, which
negotiates over the TP group inside admission.
And the natural runs, no miss injected: natural-control, natural-pristine, natural-patched and
their tp2- twins serve traffic under which upstream's own admission overcommits a chunked prefill
(NATURAL: the flags, traffic and mechanism), natural-control on a pool large enough not to miss;
a line older than a scenario's first_line runs without them (report.json names them).

Every server runs `python -m sglang.launch_server` with --skip-tokenizer-init and no CUDA graphs;
the injected runs (HICACHE) with native HiCache (write-through) and a 1024-token KV pool, under
bounded traffic that fills the device pool, evicts to host and loads back. Expected:
- control: no miss; every request finishes, host hits are seen;
- pristine: misses injected; a scheduler dies of the allocation error (its own exception, recorded
  by the hook in the scheduler process: raised in sglang's mem_cache). A pristine server that
  survives means upstream fixed the bug: reported (drop the unwind entries), not failed;
- patched: misses injected; every request finishes, every rank unwinds, the greedy outputs equal
  the control run's (tp2-patched, tp2-uneven: tp2-control's); tp2-uneven also fails when no
  reading of the free space was reduced;
- without-load-wait (CPU): misses injected; every request finishes and the hazard shows: some
  outputs differ from control's (how many is reported). Equal outputs fail: the wait went unseen.
- natural runs: the control never misses; pristine's scheduler dies of its own allocation error
  (a pristine that survives is "no natural miss this time", a failure: the run showed nothing);
  patched unwinds on every rank, every request finishes, float32 outputs equal natural-control's.
  A differing output is reported with how often its prefill was put back (by rid, from the
  scheduler's unwinds).
A run meant to inject that saw no miss fails. A run whose requests time out while its server is
alive is a hang (requests are bounded by REQUEST_TIMEOUT_S, a run by RUN_TIMEOUT_S).

The miss is injected by hook/sitecustomize.py: the KV allocator returns None inside the batch's
allocation while its HiCache load is in flight, as an elastic pool reports a miss. The server runs
in its own process group on 127.0.0.1 and is killed by its PID's group. Prints a table last;
writes report.json, report.md and every server log to --out. Exit 0 when every run met its
expectation (a surviving pristine run included), 1 otherwise, 2 when the line cannot be prepared.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import cpu_line  # beside this file (it puts the tool's package on sys.path)
from cpu_line import unpack_wheel
from packaging.version import Version

from sglang_carry.errors import CarryError

ROOT = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).resolve().parent / "hook"
CPU_STANDINS = Path(__file__).resolve().parent / "cpu"
HOST = "127.0.0.1"

# Bounded traffic: GROUPS distinct prefixes of PREFIX_TOKENS each (together several times the L1
# pool, so the early ones are evicted to host), then ROUNDS - 1 more passes that share them
# (host hits: load back). Every request is greedy with MAX_NEW_TOKENS.
GROUPS = 8
PREFIX_TOKENS = 256
SUFFIX_TOKENS = 16
ROUNDS = 3
MAX_NEW_TOKENS = 8
# A hybrid model's traffic (plan_growing_traffic): how much each wave's prompt grows.
GROWTH_TOKENS = 2
CONCURRENCY = 4
VOCAB = 1024
REQUEST_TIMEOUT_S = 60
# The device KV pool (--max-total-tokens) and the largest prefill chunk (--chunked-prefill-size).
MAX_TOTAL_TOKENS = 1024
CHUNK_TOKENS = 1024
# tp2-uneven: what rank 0's allocator withholds (reports fewer free tokens than it has), a quarter
# of the pool. A request holds PREFIX_TOKENS + SUFFIX_TOKENS + MAX_NEW_TOKENS = 280 tokens and
# CONCURRENCY (4) arrive together; 4 x 280 exceed the pool, so a full pool admits 3 at most
# (840 <= 1024) where rank 0 sees 768 free and admits 2 (560; 840 > 768): admission differs from
# the first wave on, and whenever 2 run rank 0 sees 208 free (less than one request) where rank 1
# sees 464. 768 still holds one request, so one rank alone could always make progress.
WITHHELD_TOKENS = MAX_TOTAL_TOKENS // 4
# tp2-drift and tp2-delayer: an eighth of the pool, drifting between none and all of it. The
# agreement takes the least reading, so a quarter would leave the ledger at 768 almost always,
# where upstream's decode retraction sometimes gains nothing (write-through backups still lock the
# retracted requests' nodes) and aborts its last request with a 500 (upstream's mechanism, not a
# rank disagreement); an eighth keeps these runs about the readings' drift, not that.
DRIFT_WITHHELD_TOKENS = MAX_TOTAL_TOKENS // 8
RUN_TIMEOUT_S = 600
MISS_LIMIT = 3
STARTUP_TIMEOUT_S = 900
UNWIND_LOG = re.compile(r"Prefill allocation (missed|diverged across ranks); unwound")
# The pristine scheduler's own exception must be raised where sglang allocates a prefill batch: the
# allocation helpers (a KV or row miss) or the pools (a Mamba or ping-pong slot assert).
ALLOCATION_CODE = re.compile(r"sglang/srt/mem_cache/(allocation|memory_pool)\.py:")
# The device KV pool, its paging, the running requests and the prefill chunk of the injected runs.
SMALL_POOL_FLAGS = (
    "--max-total-tokens",
    str(MAX_TOTAL_TOKENS),
    "--page-size",
    "1",
    "--max-running-requests",
    "8",
    "--chunked-prefill-size",
    str(CHUNK_TOKENS),
)
# The pool, cache and scheduling flags of the injected runs: native HiCache (write-through) over a
# small device pool, so the traffic above evicts to host and loads back.
HICACHE_FLAGS = (
    "--enable-hierarchical-cache",
    "--hicache-write-policy",
    "write_through",
    "--hicache-ratio",
    "8",
    *SMALL_POOL_FLAGS,
)
# Natural runs: upstream's own prefill allocation miss, no hook (sgl-project/sglang #30743: a
# chunked prefill continued when the budget is spent). One long prompt is chunked; short prompts
# arrive while it is. Under shortest-prefill-first, `shortest_prefill_chunk_limit`
# (managers/schedule_policy.py:418-438 in 0.5.23) caps each continuation chunk to leave room for
# the shorter waiting requests, which are then admitted beside it with their new tokens reserved;
# a prefill runs before any decode (managers/scheduler.py:3992-3994), so they keep their
# reservation while the chunks go on, until the budget's total is spent. Then
# `available_chunk_tokens` (mem_cache/prefill_budget.py:142-145: "single-pool continuation must
# make progress") hands the continuation a whole chunk anyway, more than the pool holds free, and
# `alloc_token_slots` raises "Out of memory ... Try to allocate 128 tokens"
# (mem_cache/allocation.py:160-170), which kills the scheduler. Float32, so the patched outputs
# can be compared exactly (in bf16 a re-chunked prompt can flip a greedy near-tie).
NATURAL_LONG_TOKENS = 3000
NATURAL_SHORT_TOKENS = 48
NATURAL_SHORT_REQUESTS = 30
NATURAL_SHORT_AFTER_S = 0.1
NATURAL_POOL_TOKENS = 3300
# The natural control's pool: the same traffic never misses in it.
NATURAL_ROOMY_POOL_TOKENS = 16384


def natural_flags(pool_tokens: int) -> tuple[str, ...]:
    return (
        "--schedule-policy",
        "shortest-prefill-first",
        "--max-total-tokens",
        str(pool_tokens),
        "--chunked-prefill-size",
        "128",
        "--max-running-requests",
        "64",
        "--page-size",
        "1",
        "--dtype",
        "float32",
    )


# CPU servers: sglang's CPU engine, its native attention (the x86 default needs AMX kernels).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native"]

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


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
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


# Per model: the config, its weights' names and shapes (None: --load-format dummy), extra flags.
WeightShapes = Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
MODELS: dict[str, tuple[dict[str, Any], WeightShapes | None, list[str]]] = {
    "dense": (DENSE_LLAMA, llama_weight_shapes, []),
    "hybrid": (HYBRID_QWEN3_5, None, ["--load-format", "dummy", "--max-mamba-cache-size", "32"]),
    "lfm2": (HYBRID_LFM2, lfm2_weight_shapes, []),
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
            initial = dense_weight if name == "dense" else initial_weight
            tensors = {
                key: initial(key, shape, generator).to(torch.bfloat16)
                for key, shape in weight_shapes(config).items()
            }
            save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        dirs[name] = model_dir
    return dirs


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_command(
    python: str, model_dir: Path, port: int, extra: Sequence[str] = (), scenario_flags: Sequence[str] = ()
) -> list[str]:
    """The server's command line: what every run shares, the scenario's pool and scheduling flags
    (default: HICACHE's), then the run's own."""
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--host",
        HOST,
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--mem-fraction-static",
        "0.3",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--enable-cache-report",
        "--random-seed",
        "0",
        "--log-level",
        "info",
        *(scenario_flags or HICACHE_FLAGS),
        *extra,
    ]


@dataclass
class Server:
    """A server in its own process group; stopped by signalling that group (its PID)."""

    process: subprocess.Popen[bytes]
    log: Path
    base_url: str

    @classmethod
    def start(cls, command: Sequence[str], env: dict[str, str], log: Path, port: int) -> Server:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            process = subprocess.Popen(
                list(command), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return cls(process, log, f"http://{HOST}:{port}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                return False
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll_s)
        return False

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process.poll() is None:
            with _no_such_process():
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        # The scheduler and detokenizer processes are in the same group: none may outlive it.
        with _no_such_process():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=grace_s)


class _no_such_process:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


# --------------------------------------------------------------------------------------------
# Traffic
# --------------------------------------------------------------------------------------------
@dataclass
class Request:
    key: str  # e.g. "round.group": the same key in two runs is the same prompt (and its rid)
    input_ids: list[int]
    # Sent this long after its wave starts (every request of a wave is in flight at once).
    send_after_s: float = 0.0


@dataclass
class Outcome:
    key: str
    ok: bool
    output_ids: list[int] = field(default_factory=list)
    host_cached: int = 0
    cached: int = 0
    error: str = ""


def plan_traffic(seed: int = 0) -> list[list[Request]]:
    """ROUNDS waves; wave r holds one request per prefix group, with a suffix of its own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(GROUPS)]
    return [
        [
            Request(f"{r}.{g}", prefixes[g] + [rng.randrange(3, VOCAB) for _ in range(SUFFIX_TOKENS)])
            for g in range(GROUPS)
        ]
        for r in range(ROUNDS)
    ]


def plan_growing_traffic(seed: int = 0) -> list[list[Request]]:
    """ROUNDS waves of GROUPS prompts; wave 0's are PREFIX_TOKENS + SUFFIX_TOKENS long, and each
    later wave's prompt is the same group's previous one plus GROWTH_TOKENS new tokens. A
    no_buffer Mamba tree keeps a state only where a prefill ended, so only a prompt that extends
    an earlier one can load a Mamba state back; and a short conv remembers only its last few
    tokens, so the growth is short enough that the loaded state decides the outputs."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(PREFIX_TOKENS + SUFFIX_TOKENS)] for _ in range(GROUPS)]
    waves = []
    for r in range(ROUNDS):
        if r:
            prompts = [prompt + [rng.randrange(3, VOCAB) for _ in range(GROWTH_TOKENS)] for prompt in prompts]
        waves.append([Request(f"{r}.{g}", list(prompt)) for g, prompt in enumerate(prompts)])
    return waves


def plan_natural_traffic(seed: int = 0) -> list[list[Request]]:
    """One wave: the long prompt, then (NATURAL_SHORT_AFTER_S later, while it is chunked) the
    short ones, all at once."""
    rng = random.Random(seed)
    long = Request("long", [rng.randrange(3, VOCAB) for _ in range(NATURAL_LONG_TOKENS)])
    shorts = [
        Request(
            f"short.{i}",
            [rng.randrange(3, VOCAB) for _ in range(NATURAL_SHORT_TOKENS)],
            NATURAL_SHORT_AFTER_S,
        )
        for i in range(NATURAL_SHORT_REQUESTS)
    ]
    return [[long, *shorts]]


@dataclass(frozen=True)
class Scenario:
    """What a run's server is given and sent: its pool, cache and scheduling flags (the control
    run's may differ), the traffic (waves) and how many requests are in flight at once. Where the
    misses come from: the hook (`injects`) or the server itself."""

    name: str
    flags: tuple[str, ...]
    control_flags: tuple[str, ...]
    plan: Callable[[], list[list[Request]]]
    concurrency: int
    injects: bool
    # A control must see host hits and loads (the traffic's prefixes come back from host).
    control_loads_from_host: bool
    # The first sglang line whose code has what the scenario relies on.
    first_line: str = "0.5.20"
    # The model it serves (MODELS), and the flags of a run that recomputes every prompt (no
    # prefix cache, no HiCache): the reference a control's outputs must equal (None: no such run).
    model: str = "dense"
    recompute_flags: tuple[str, ...] | None = None
    # The model has a Mamba state: a control must load some back from host, and a patched run
    # must land no load copy in a Mamba slot after that slot was released.
    mamba_state: bool = False

    def keys(self) -> set[str]:
        return {request.key for wave in self.plan() for request in wave}


HICACHE = Scenario("hicache", HICACHE_FLAGS, HICACHE_FLAGS, plan_traffic, CONCURRENCY, True, True)
# The control serves the same traffic from a pool large enough not to miss.
NATURAL = Scenario(
    "natural",
    natural_flags(NATURAL_POOL_TOKENS),
    natural_flags(NATURAL_ROOMY_POOL_TOKENS),
    plan_natural_traffic,
    NATURAL_SHORT_REQUESTS + 1,
    False,
    False,
    # shortest-prefill-first and its chunk limit came in 0.5.21.
    first_line="0.5.21",
)
# The hybrid LFM2 under HICACHE's pool and cache, its Mamba state (the conv state) backed up to
# host and loaded back (no_buffer: the only Mamba strategy on CPU; extra_buffer is refused there).
# no_buffer refuses the overlap scheduler (arg_groups/mamba_hook.py:158).
LFM2_FLAGS = (
    *HICACHE_FLAGS,
    "--mamba-radix-cache-strategy",
    "no_buffer",
    "--max-mamba-cache-size",
    "16",
    "--disable-overlap-schedule",
)
LFM2 = Scenario(
    "lfm2",
    LFM2_FLAGS,
    LFM2_FLAGS,
    plan_growing_traffic,
    CONCURRENCY,
    True,
    True,
    model="lfm2",
    mamba_state=True,
    first_line="0.5.20",
    recompute_flags=("--disable-radix-cache", *SMALL_POOL_FLAGS, "--max-mamba-cache-size", "16"),
)


def generate(base_url: str, request: Request, timeout_s: float = REQUEST_TIMEOUT_S) -> Outcome:
    time.sleep(request.send_after_s)
    body = json.dumps(
        {
            "input_ids": request.input_ids,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
            "rid": request.key,
        }
    ).encode()
    post = urllib.request.Request(
        f"{base_url}/generate", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(post, timeout=timeout_s) as response:
            answer = json.load(response)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
        return Outcome(request.key, False, error=f"{type(error).__name__}: {error}")
    meta = answer.get("meta_info", {})
    details = meta.get("cached_tokens_details") or {}
    finish = meta.get("finish_reason") or {}
    ok = isinstance(finish, dict) and finish.get("type") in ("length", "stop")
    return Outcome(
        request.key,
        ok,
        output_ids=list(answer.get("output_ids", [])),
        host_cached=int(details.get("host", 0) or 0),
        cached=int(meta.get("cached_tokens", 0) or 0),
        error="" if ok else f"finish_reason {finish!r}",
    )


def drive(
    base_url: str,
    waves: list[list[Request]],
    alive: Callable[[], bool],
    deadline: float | None = None,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    concurrency: int = CONCURRENCY,
) -> list[Outcome]:
    """Send every wave (`concurrency` at a time), stopping early once the server is gone or the
    run's deadline (time.monotonic()) has passed; no request outlives the deadline."""

    def timeout() -> float:
        left = request_timeout_s if deadline is None else deadline - time.monotonic()
        return max(0.1, min(request_timeout_s, left))

    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for number, wave in enumerate(waves):
            if not alive():
                outcomes += [Outcome(r.key, False, error="server gone") for r in wave]
                continue
            if deadline is not None and time.monotonic() >= deadline:
                outcomes += [Outcome(r.key, False, error="run timed out") for r in wave]
                continue
            answered = list(pool.map(lambda r: generate(base_url, r, timeout()), wave))
            outcomes += answered
            if any(map(timed_out, answered)) and alive():
                # It hung: the later waves would only time out too (the run's bound, not a verdict).
                later = [r for w in waves[number + 1 :] for r in w]
                outcomes += [Outcome(r.key, False, error="not sent: an earlier request hung") for r in later]
                break
    return outcomes


def timed_out(outcome: Outcome) -> bool:
    return "timed out" in outcome.error


# --------------------------------------------------------------------------------------------
# One run and its verdict
# --------------------------------------------------------------------------------------------
CONTROL, PRISTINE, PATCHED, WITHOUT_LOAD_WAIT = "control", "pristine", "patched", "without-load-wait"
# The scenario's reference: the patched wheel recomputing every prompt (no prefix cache, no HiCache).
RECOMPUTE = "recompute"
INJECTING = (PRISTINE, PATCHED, WITHOUT_LOAD_WAIT)
# The kinds whose outputs are compared with their control run's.
COMPARING = (PATCHED, WITHOUT_LOAD_WAIT, RECOMPUTE)


@dataclass(frozen=True)
class RunSpec:
    """One server run: what it serves (`site` first on PYTHONPATH, else the interpreter's own
    sglang) and how it is broken (the kind)."""

    name: str  # e.g. "patched", "tp2-control"
    kind: str  # control | pristine | patched | without-load-wait
    site: Path | None = None
    tp: int = 1
    # Where misses are injected (None: every rank) and whether the pool is marked rank-local.
    miss_ranks: tuple[int, ...] | None = None
    rank_local: bool = False
    # Environment this run's server needs beyond the others'.
    extra_env: tuple[tuple[str, str], ...] = ()
    # Ranks of different free space: the allocator reports this many tokens fewer than it has, on
    # withhold_ranks (None: every rank), while the scheduler is busy (hook/sitecustomize.py).
    withheld_tokens: int = 0
    withhold_ranks: tuple[int, ...] | None = None
    # The withheld amount changes at every reading (as kvcached's physical reading does).
    withheld_drift: bool = False
    # Server flags this run adds (the prefill delayer).
    server_flags: tuple[str, ...] = ()
    # Where the misses are injected: a prefill batch's allocation, or a decode step's.
    miss_at: str = "prefill"
    scenario: Scenario = HICACHE

    @property
    def control_name(self) -> str:
        ranks = "" if self.tp == 1 else f"tp{self.tp}-"
        scenario = "" if self.scenario is HICACHE else f"{self.scenario.name}-"
        return f"{ranks}{scenario}{CONTROL}"

    def server_flags_of_scenario(self) -> tuple[str, ...]:
        if self.kind == RECOMPUTE:
            assert self.scenario.recompute_flags is not None, f"{self.scenario.name} has no recompute run"
            return self.scenario.recompute_flags
        return self.scenario.control_flags if self.kind == CONTROL else self.scenario.flags


@dataclass
class Run:
    model: str
    name: str
    kind: str
    tp: int = 1
    withheld_tokens: int = 0
    miss_at: str = "prefill"
    withheld_drift: bool = False
    scenario: str = HICACHE.name
    started: bool = False
    finished: int = 0
    failed: int = 0
    hung: bool = False
    host_cached_tokens: int = 0
    # Per TP rank (JSON keys are the rank as text), from the hook's counters in each scheduler.
    misses: dict[str, int] = field(default_factory=dict)
    unwinds: dict[str, int] = field(default_factory=dict)
    # Decode retractions after a decode step's allocation missed (the carried decode agreement).
    decode_retractions: dict[str, int] = field(default_factory=dict)
    # Readings of the allocator's available_size() that were reduced (withheld_tokens > 0), and how
    # many different amounts they withheld.
    withheld_readings: dict[str, int] = field(default_factory=dict)
    withheld_amounts: dict[str, int] = field(default_factory=dict)
    died_with: dict[str, str] = field(default_factory=dict)
    loads_started: int = 0
    unwinds_logged: int = 0
    server_died: bool = False
    outputs_equal_control: bool | None = None
    outputs_differing: int | None = None
    # Each request whose output differs from the control's, with how often its prefill was put
    # back (the most on any rank, from the scheduler's own unwinds).
    differing_requests: dict[str, int] = field(default_factory=dict)
    # Requests whose prefill was put back, and how often (the most on any rank).
    unwound_requests: dict[str, int] = field(default_factory=dict)
    # A hybrid model's Mamba state, from the CPU stand-ins' copy kernels in the servers: load
    # copies landed in device Mamba slots, and those that landed after their slot was released
    # (the seed's hazard, counted).
    mamba_loads: int = 0
    mamba_late_copies: int = 0
    verdict: str = ""
    ok: bool = False
    seconds: float = 0.0
    peak_rss_mb: int = 0
    log: str = ""

    @property
    def injected_misses(self) -> int:
        return sum(self.misses.values())

    @property
    def recoveries(self) -> dict[str, int]:
        """What each rank did after a miss, per rank: put the prefill batch back (unwinds), or,
        after a decode miss, retract."""
        return self.decode_retractions if self.miss_at == "decode" else self.unwinds

    @property
    def recovery(self) -> str:
        return "retracted after a decode miss" if self.miss_at == "decode" else "unwound"


def read_counters(folder: Path) -> list[dict[str, Any]]:
    """The hook's counters, one record per process that wrote any."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def take_counters(run: Run, records: list[dict[str, Any]]) -> None:
    for record in records:
        rank = str(record.get("rank", 0))
        run.misses[rank] = run.misses.get(rank, 0) + int(record.get("injected_misses", 0))
        run.unwinds[rank] = run.unwinds.get(rank, 0) + int(record.get("unwinds", 0))
        retractions = int(record.get("decode_retractions", 0))
        run.decode_retractions[rank] = run.decode_retractions.get(rank, 0) + retractions
        withheld = int(record.get("withheld_readings", 0))
        run.withheld_readings[rank] = run.withheld_readings.get(rank, 0) + withheld
        amounts = int(record.get("withheld_amounts", 0))
        run.withheld_amounts[rank] = max(run.withheld_amounts.get(rank, 0), amounts)
        run.loads_started += int(record.get("loads_started", 0))
        run.mamba_loads += int(record.get("mamba_copies_landed", 0))
        run.mamba_late_copies += int(record.get("mamba_late_copies", 0))
        for rid, times in (record.get("unwound_rids") or {}).items():
            run.unwound_requests[rid] = max(run.unwound_requests.get(rid, 0), int(times))
        died = record.get("died_with")
        if died:
            run.died_with[rank] = f"{died['type']}: {died['message'].strip()} (raised in {died['raised_in']})"


def died_of_allocation(run: Run, injected: bool) -> list[str]:
    """The ranks whose scheduler's own exception was raised in sglang's prefill allocation code
    (and, where the misses are injected, that had one injected)."""
    return sorted(
        rank
        for rank, error in run.died_with.items()
        if ALLOCATION_CODE.search(error) and (run.misses.get(rank, 0) > 0 or not injected)
    )


def complete(
    control: dict[str, list[int]] | None, scenario: Scenario = HICACHE
) -> TypeGuard[dict[str, list[int]]]:
    """A control run to compare with: it answered every request of the traffic."""
    return control is not None and set(control) == scenario.keys()


def judge(
    run: Run, outcomes: list[Outcome], control: dict[str, list[int]] | None, scenario: Scenario = HICACHE
) -> None:
    """Set run.verdict / run.ok from what the run showed, against its kind's expectation."""
    run.finished = sum(o.ok for o in outcomes)
    run.failed = len(outcomes) - run.finished
    run.host_cached_tokens = sum(o.host_cached for o in outcomes)
    everything = run.failed == 0 and run.started
    if complete(control, scenario) and everything:
        differing_keys = [o.key for o in outcomes if o.output_ids != control.get(o.key)]
        run.differing_requests = {key: run.unwound_requests.get(key, 0) for key in differing_keys}
        run.outputs_differing = len(differing_keys)
        run.outputs_equal_control = run.outputs_differing == 0
    every_rank = [str(rank) for rank in range(run.tp)]
    unwound_everywhere = all(run.recoveries.get(rank, 0) > 0 for rank in every_rank)
    if not run.started:
        run.ok, run.verdict = False, "the server never became healthy"
    elif scenario.injects and run.kind in INJECTING and run.injected_misses == 0:
        run.ok, run.verdict = (
            False,
            (
                "no miss was injected (no decode step of two requests or more)"
                if run.miss_at == "decode"
                else "no miss was injected (no load in flight at an allocation)"
            ),
        )
    elif run.withheld_tokens > 0 and not any(run.withheld_readings.values()):
        run.ok, run.verdict = False, "nothing was withheld (no reading of the free space was reduced)"
    elif run.withheld_drift and max(run.withheld_amounts.values(), default=0) < 2:
        run.ok, run.verdict = False, "the withheld reading did not drift (one amount withheld throughout)"
    elif run.kind in COMPARING and not complete(control, scenario):
        run.ok, run.verdict = False, "no complete control run to compare the outputs with"
    elif run.hung:
        run.ok, run.verdict = (
            False,
            f"HANG: {sum(map(timed_out, outcomes))} request(s) timed out, server alive",
        )
    elif run.kind == CONTROL and not scenario.control_loads_from_host:
        # The reference of a natural run: its pool never missed, so nothing was put back.
        run.ok = everything and not any(run.unwinds.values()) and not run.died_with
        run.verdict = (
            "all requests finished, no miss"
            if run.ok
            else f"{run.failed} failed, unwinds {run.unwinds}, died with {run.died_with or 'nothing'}"
        )
    elif run.kind == CONTROL:
        mamba_loaded = run.mamba_loads > 0 or not scenario.mamba_state
        run.ok = bool(
            everything
            and run.host_cached_tokens > 0
            and run.loads_started > 0
            and mamba_loaded
            and not run.died_with
        )
        run.verdict = (
            f"all requests finished, host hits seen{', Mamba states loaded' if scenario.mamba_state else ''}"
            if run.ok
            else f"{run.failed} failed, host-cached tokens {run.host_cached_tokens},"
            f" loads {run.loads_started}, Mamba loads {run.mamba_loads},"
            f" died with {run.died_with or 'nothing'}"
        )
    elif run.kind == RECOMPUTE:
        run.ok = bool(everything and run.outputs_equal_control and not run.died_with)
        run.verdict = (
            "every output equals the control run's"
            if run.ok
            else f"{run.failed} failed, outputs equal control: {run.outputs_equal_control}"
            f" ({run.outputs_differing} differ), died with {run.died_with or 'nothing'}"
        )
    elif run.kind == PRISTINE:
        if run.server_died or run.failed or run.died_with:
            ranks = died_of_allocation(run, scenario.injects)
            run.ok = bool(ranks)
            run.verdict = (
                f"the scheduler died with the allocation error (as expected; rank {', '.join(ranks)})"
                if run.ok
                else "the server died, but no scheduler of the allocation error"
                f" ({run.died_with or 'no error recorded'})"
            )
        elif scenario.injects:
            run.ok = True
            run.verdict = "UPSTREAM FIXED IT: pristine survived the injected misses (drop the unwind entries)"
        else:
            # The traffic did not bring the miss about this time (or upstream fixed it): the run
            # showed nothing, so it cannot pass.
            run.ok, run.verdict = False, "no natural miss this time: pristine survived its traffic"
    elif run.kind == PATCHED:
        run.ok = bool(
            everything
            and unwound_everywhere
            and run.outputs_equal_control
            and not run.died_with
            and run.mamba_late_copies == 0
        )
        differ = run.outputs_differing
        each = f" ({differ} differ, each with its unwinds: {run.differing_requests})" if differ else ""
        run.verdict = (
            f"every request finished, every rank {run.recovery}, outputs equal the control run's"
            if run.ok
            else (
                f"{run.failed} failed, misses {run.misses}, {run.recovery}: {run.recoveries},"
                f" outputs equal control: {run.outputs_equal_control}"
                f"{each}, Mamba copies landed after their slot's release: {run.mamba_late_copies},"
                f" died with {run.died_with or 'nothing'}"
            )
        )
    else:
        differing = run.outputs_differing or 0
        run.ok = bool(everything and unwound_everywhere and differing > 0 and not run.died_with)
        run.verdict = (
            f"the hazard showed: {differing} of {len(outcomes)} outputs differ from the control run's"
            + (
                f"; {run.mamba_late_copies} Mamba copies landed after their slot's release"
                if scenario.mamba_state
                else ""
            )
            if run.ok
            else (
                "the missing wait went unseen: outputs equal the control run's"
                if everything and unwound_everywhere and differing == 0
                else f"{run.failed} failed, misses {run.misses}, unwinds {run.unwinds},"
                f" died with {run.died_with or 'nothing'}"
            )
        )


class PeakMemory:
    """The largest resident size of a process and its descendants, sampled every second."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_bytes = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        try:
            import psutil  # type: ignore[import-untyped, unused-ignore]
        except ImportError:
            return
        while not self._stop.wait(1.0):
            try:
                root = psutil.Process(self.pid)
                tree = [root, *root.children(recursive=True)]
                total = 0
                for process in tree:
                    with contextlib.suppress(psutil.Error):
                        total += process.memory_info().rss
                self.peak_bytes = max(self.peak_bytes, total)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_bytes // (1 << 20)


def run_once(
    model: str,
    spec: RunSpec,
    command: Sequence[str],
    out: Path,
    base_env: dict[str, str],
    pythonpath: Sequence[Path],
    control: dict[str, list[int]] | None,
    port: int,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    run_timeout_s: float = RUN_TIMEOUT_S,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[Run, list[Outcome]]:
    started_at = time.monotonic()
    log = f"{model}-{spec.name}.log"
    scenario = spec.scenario
    run = Run(
        model,
        spec.name,
        spec.kind,
        spec.tp,
        spec.withheld_tokens,
        spec.miss_at,
        spec.withheld_drift,
        scenario.name,
        log=log,
    )
    counters = out / "counters" / f"{model}-{spec.name}"
    shutil.rmtree(counters, ignore_errors=True)
    env = dict(base_env)
    path = [*map(str, [*([spec.site] if spec.site else []), *pythonpath, HOOK]), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path).rstrip(os.pathsep)
    env["CARRY_E2E_COUNTERS_DIR"] = str(counters)
    # The hook runs in every run (it counts loads and unwinds and records a scheduler's death); a
    # control or recompute run, and a run whose misses are the server's own (natural), inject nothing.
    env["CARRY_E2E_INJECT"] = "1"
    env["CARRY_E2E_MISS_LIMIT"] = str(MISS_LIMIT) if scenario.injects and spec.kind in INJECTING else "0"
    if spec.miss_ranks is not None:
        env["CARRY_E2E_MISS_RANKS"] = ",".join(map(str, spec.miss_ranks))
    if spec.rank_local:
        env["CARRY_E2E_RANK_LOCAL"] = "1"
    if scenario.mamba_state:
        env["CARRY_E2E_MAMBA"] = "1"
    if spec.miss_at != "prefill":
        env["CARRY_E2E_MISS_AT"] = spec.miss_at
    if spec.withheld_tokens:
        env["CARRY_E2E_WITHHELD_TOKENS"] = str(spec.withheld_tokens)
        if spec.withhold_ranks is not None:
            env["CARRY_E2E_WITHHOLD_RANKS"] = ",".join(map(str, spec.withhold_ranks))
        if spec.withheld_drift:
            env["CARRY_E2E_WITHHELD_DRIFT"] = "1"
    env.update(spec.extra_env)
    server = Server.start(command, env, out / run.log, port)
    memory = PeakMemory(server.process.pid)
    outcomes: list[Outcome] = []
    try:
        run.started = server.wait_healthy(startup_timeout_s)
        if run.started:
            deadline = time.monotonic() + run_timeout_s
            outcomes = drive(
                server.base_url,
                scenario.plan(),
                server.alive,
                deadline,
                request_timeout_s,
                scenario.concurrency,
            )
            # Requests that timed out while the server was still up: it hung (it may die later).
            run.hung = server.alive() and any(timed_out(o) for o in outcomes)
            time.sleep(1.0)  # let a dying scheduler take the server down before we look
        run.server_died = not server.alive()
    finally:
        run.peak_rss_mb = memory.stop()
        server.stop()
    text = (out / run.log).read_text(errors="replace")
    take_counters(run, read_counters(counters))
    run.unwinds_logged = len(UNWIND_LOG.findall(text))
    if not run.started:
        outcomes = [
            Outcome(r.key, False, error="server never became healthy") for w in scenario.plan() for r in w
        ]
    judge(run, outcomes, control, scenario)
    run.seconds = time.monotonic() - started_at
    return run, outcomes


def official_wheel_of(patched: Path) -> Path:
    """The upstream wheel a patched wheel was built from, in upstream/.downloads (its provenance)."""
    with zipfile.ZipFile(patched) as archive:
        name = next(n for n in archive.namelist() if n.endswith("sglang_carry_provenance.json"))
        upstream: str = json.loads(archive.read(name))["upstream"]["file"]
    return ROOT / "upstream" / ".downloads" / upstream


def per_rank(counts: dict[str, int]) -> str:
    return " ".join(f"{rank}:{n}" for rank, n in sorted(counts.items())) or "-"


def table(runs: Sequence[Run]) -> list[str]:
    lines = [
        f"{'model':<7} {'run':<23} {'ok':<3} {'done':>4} {'fail':>4} {'host':>5} {'miss':>11}"
        f" {'unw/retr':>11} {'diff':>4} {'s':>4}  verdict"
    ]
    for r in runs:
        differing = "-" if r.outputs_differing is None else str(r.outputs_differing)
        lines.append(
            f"{r.model:<7} {r.name:<23} {'yes' if r.ok else 'NO':<3} {r.finished:>4} {r.failed:>4}"
            f" {r.host_cached_tokens:>5} {per_rank(r.misses):>11} {per_rank(r.recoveries):>11} {differing:>4}"
            f" {r.seconds:>4.0f}  {r.verdict}"
        )
    return lines


def two_ranks(name: str, kind: str, **more: Any) -> RunSpec:
    """A --tp-size 2 run on CPU: the pool rank-local on both ranks (as a kvcached pool is), and
    each rank's OpenMP core named, which sglang's CPU engine requires with more than one rank."""
    omp = (("SGLANG_CPU_OMP_THREADS_BIND", "0|1"),)
    return RunSpec(name, kind, tp=2, rank_local=True, extra_env=omp, **more)


def uneven_ranks(name: str, withheld_tokens: int, **more: Any) -> RunSpec:
    """A patched two-rank run whose ranks' free space differs: rank 0 reports `withheld_tokens`
    fewer free tokens than it has (a co-tenant of an elastic pool), and rank 1 misses."""
    return two_ranks(
        name, PATCHED, miss_ranks=(1,), withheld_tokens=withheld_tokens, withhold_ranks=(0,), **more
    )


# The CPU runs, in the order they run (each control before the runs compared with it), each with
# what it serves: "pristine" and "patched" (the wheels), or the tree without the load wait.
CPU_PLAN: tuple[tuple[RunSpec, str], ...] = (
    (RunSpec(CONTROL, CONTROL), PATCHED),
    (RunSpec(PRISTINE, PRISTINE), PRISTINE),
    (RunSpec(PATCHED, PATCHED), PATCHED),
    (RunSpec(WITHOUT_LOAD_WAIT, WITHOUT_LOAD_WAIT), WITHOUT_LOAD_WAIT),
    (two_ranks("tp2-control", CONTROL), PATCHED),
    (two_ranks("tp2-pristine", PRISTINE, miss_ranks=(1,)), PRISTINE),
    (two_ranks("tp2-patched", PATCHED, miss_ranks=(1,)), PATCHED),
    # As tp2-patched, and rank 0 reports WITHHELD_TOKENS fewer free tokens than it has (a
    # co-tenant of an elastic pool): the ranks' free space differs, so they can admit and evict
    # differently. Kind patched: every request finishes, outputs equal tp2-control's.
    (uneven_ranks("tp2-uneven", WITHHELD_TOKENS), PATCHED),
    # As tp2-uneven, with rank 0's reading changing at every read (none, a third, two thirds, all
    # of DRIFT_WITHHELD_TOKENS, in turn), as kvcached's TTL-cached physical reading makes it drift: the
    # ranks agree on a ledger, so they still admit, evict and retract alike.
    (uneven_ranks("tp2-drift", DRIFT_WITHHELD_TOKENS, withheld_drift=True), PATCHED),
    # As tp2-drift's withholding (steady), with the prefill delayer, which negotiates over the TP
    # group inside admission from the pools' usage.
    (uneven_ranks("tp2-delayer", DRIFT_WITHHELD_TOKENS, server_flags=("--enable-prefill-delayer",)), PATCHED),
    # The miss in a decode step's allocation on rank 1 only (a co-tenant took the physical memory
    # the agreed ledger counts): pristine's rank 1 dies while rank 0 waits in the forward; the
    # series gives the step back and retracts the same request on both ranks.
    (two_ranks("tp2-decode-pristine", PRISTINE, miss_ranks=(1,), miss_at="decode"), PRISTINE),
    (two_ranks("tp2-decode-patched", PATCHED, miss_ranks=(1,), miss_at="decode"), PATCHED),
    # Upstream's own prefill allocation miss (NATURAL: no hook, the traffic and flags bring it
    # about): pristine dies of it; the series puts the batch back and serves everything, its
    # outputs equal to the same traffic's on a pool that never misses (natural-control).
    (RunSpec("natural-control", CONTROL, scenario=NATURAL), PATCHED),
    (RunSpec("natural-pristine", PRISTINE, scenario=NATURAL), PRISTINE),
    (RunSpec("natural-patched", PATCHED, scenario=NATURAL), PATCHED),
    (two_ranks("tp2-natural-control", CONTROL, scenario=NATURAL), PATCHED),
    (two_ranks("tp2-natural-pristine", PRISTINE, scenario=NATURAL), PRISTINE),
    (two_ranks("tp2-natural-patched", PATCHED, scenario=NATURAL), PATCHED),
    # The hybrid LFM2 (LFM2: its conv state backed up to host and loaded back): the control's
    # outputs equal a run that recomputes every prompt; the miss is injected as for the dense
    # model; the series without its load wait shows the seed's hazard, counted by the copies that
    # landed in a Mamba slot after its release.
    (RunSpec("lfm2-control", CONTROL, scenario=LFM2), PATCHED),
    (RunSpec("lfm2-recompute", RECOMPUTE, scenario=LFM2), PATCHED),
    (RunSpec("lfm2-pristine", PRISTINE, scenario=LFM2), PRISTINE),
    (RunSpec("lfm2-patched", PATCHED, scenario=LFM2), PATCHED),
    (RunSpec("lfm2-without-load-wait", WITHOUT_LOAD_WAIT, scenario=LFM2), WITHOUT_LOAD_WAIT),
    (two_ranks("tp2-lfm2-control", CONTROL, scenario=LFM2), PATCHED),
    (two_ranks("tp2-lfm2-pristine", PRISTINE, miss_ranks=(1,), scenario=LFM2), PRISTINE),
    (two_ranks("tp2-lfm2-patched", PATCHED, miss_ranks=(1,), scenario=LFM2), PATCHED),
)
CPU_RUNS = tuple(spec.name for spec, _ in CPU_PLAN)
CPU_MODEL_OF = {spec.name: spec.scenario.model for spec, _ in CPU_PLAN}
CPU_MODELS = tuple(dict.fromkeys(CPU_MODEL_OF.values()))


def runs_not_on_line(names: Sequence[str], version: str) -> dict[str, str]:
    """The runs among `names` whose scenario the line's code lacks, each with the reason."""
    return {
        spec.name: f"needs sglang {spec.scenario.first_line} or newer ({spec.scenario.name})"
        for spec, _ in CPU_PLAN
        if spec.name in names and Version(version) < Version(spec.scenario.first_line)
    }


def runs_without_their_control(names: Sequence[str]) -> list[str]:
    return [
        f"{spec.name} needs {spec.control_name}"
        for spec, _ in CPU_PLAN
        if spec.name in names and spec.kind in COMPARING and spec.control_name not in names
    ]


def cpu_specs(line: Any, out: Path, names: Sequence[str]) -> list[RunSpec]:
    """The chosen runs of CPU_PLAN, each with the folder it serves (the wheels are unpacked)."""
    sites = {
        PRISTINE: unpack_wheel(line.pristine_wheel, out / "sites" / "pristine"),
        PATCHED: unpack_wheel(line.patched_wheel, out / "sites" / "patched"),
        WITHOUT_LOAD_WAIT: line.without_load_wait,
    }
    return [dataclasses.replace(spec, site=sites[serves]) for spec, serves in CPU_PLAN if spec.name in names]


def cpu_env(base: dict[str, str], out: Path) -> dict[str, str]:
    env = dict(base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["CARRY_E2E_CPU"] = "1"
    # A CUDA build of torch beside an NCCL wheel makes the CPU platform try pynccl; point it nowhere.
    env["SGLANG_NCCL_SO_PATH"] = str(out / "no-libnccl.so")
    # No JIT cache shared with another tree or run.
    env["TORCH_EXTENSIONS_DIR"] = str(out / "torch-extensions")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/e2e/run_e2e.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--upstream", help="CPU: the sglang line (default: the newest with a series)")
    parser.add_argument("--wheel", type=Path, help="GPU: the patched wheel (installed in this venv)")
    parser.add_argument(
        "--pristine-wheel", type=Path, help="GPU: the official wheel (default: from the provenance)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=None, help="GPU: dense,hybrid; CPU: dense,lfm2 (default: all)")
    parser.add_argument(
        "--runs",
        default=None,
        help="CPU: which runs, in the order of CPU_PLAN (default: all the line has)",
    )
    parser.add_argument("--python", default=sys.executable, help="GPU: the interpreter that runs the servers")
    parser.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S)
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S, help="a run's traffic, at most")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARRY_E2E_")}
    report: dict[str, Any] = {"device": args.device}
    plans: list[tuple[str, list[str], list[RunSpec], list[Path], str]] = []
    if args.device == "cpu":
        names = [n for n in (args.runs or ",".join(CPU_RUNS)).split(",") if n]
        unknown = sorted(set(names) - set(CPU_RUNS))
        chosen_models = [m for m in (args.models or ",".join(CPU_MODELS)).split(",") if m]
        unknown_models = sorted(set(chosen_models) - set(CPU_MODELS))
        if unknown or unknown_models:
            what = f"unknown run(s) {', '.join(unknown)}" if unknown else f"--models {args.models}"
            print(
                f"e2e: error: {what}: on CPU the runs are {', '.join(CPU_RUNS)},"
                f" the models {', '.join(CPU_MODELS)}",
                file=sys.stderr,
            )
            return 2
        names = [name for name in names if CPU_MODEL_OF[name] in chosen_models]
        missing = runs_without_their_control(names)
        if missing:
            print(
                f"e2e: error: --runs: {'; '.join(missing)} (its outputs are compared with it)",
                file=sys.stderr,
            )
            return 2
        try:
            line = cpu_line.prepare(args.upstream, out)
            absent = runs_not_on_line(names, line.version)
            if absent and args.runs is not None:
                what = "; ".join(f"{name} {why}" for name, why in absent.items())
                print(
                    f"e2e: error: --runs: {what} (the line is {line.version}): leave it out", file=sys.stderr
                )
                return 2
            specs = cpu_specs(line, out, [name for name in names if name not in absent])
        except (CarryError, subprocess.CalledProcessError, OSError, zipfile.BadZipFile) as error:
            print(f"e2e: error: the line cannot be prepared: {error}", file=sys.stderr)
            return 2
        env = cpu_env(env, out)
        for model in dict.fromkeys(spec.scenario.model for spec in specs):
            chosen = [spec for spec in specs if spec.scenario.model == model]
            plans.append((model, CPU_FLAGS, chosen, [CPU_STANDINS, line.server_deps], str(line.python)))
        report |= {
            "runs_not_on_this_line": absent,
            "upstream": line.version,
            "wheel": line.patched_wheel.name,
            "pristine_wheel": line.pristine_wheel.name,
            "without_load_wait": f"the series without {line.load_wait_entry}",
        }
    else:
        if args.wheel is None:
            print(
                "e2e: error: --wheel is required on a GPU (the patched wheel in this venv)", file=sys.stderr
            )
            return 2
        pristine_wheel = args.pristine_wheel or official_wheel_of(args.wheel)
        pristine_site = unpack_wheel(pristine_wheel, out / "pristine-site")
        for name in [n for n in (args.models or "dense,hybrid").split(",") if n]:
            specs = [
                RunSpec(CONTROL, CONTROL),
                RunSpec(PRISTINE, PRISTINE, pristine_site),
                RunSpec(PATCHED, PATCHED),
            ]
            plans.append((name, MODELS[name][2], specs, [], args.python))
        report |= {"wheel": args.wheel.name, "pristine_wheel": pristine_wheel.name}
    models = write_models(out / "models", [plan[0] for plan in plans])
    runs: list[Run] = []
    for model, extra, specs, pythonpath, python in plans:
        controls: dict[str, dict[str, list[int]]] = {}
        for spec in specs:
            port = free_port()
            flags = [*extra, *(["--tp-size", str(spec.tp)] if spec.tp > 1 else []), *spec.server_flags]
            command = server_command(python, models[model], port, flags, spec.server_flags_of_scenario())
            control = controls.get(spec.control_name) if spec.kind != CONTROL else None
            run, outcomes = run_once(
                model,
                spec,
                command,
                out,
                env,
                pythonpath,
                control,
                port,
                run_timeout_s=args.run_timeout_s,
                request_timeout_s=args.request_timeout_s,
            )
            if spec.kind == CONTROL:
                controls[spec.name] = {o.key: o.output_ids for o in outcomes if o.ok}
            runs.append(run)
            print(f"e2e: {model} {spec.name}: {run.verdict} ({run.seconds:.0f} s)", flush=True)
    upstream_fixed = [
        f"{r.model} {r.name}" for r in runs if r.kind == PRISTINE and r.verdict.startswith("UPSTREAM FIXED")
    ]
    report |= {"runs": [asdict(r) for r in runs], "upstream_fixed": upstream_fixed}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = table(runs)
    (out / "report.md").write_text("```\n" + "\n".join(lines) + "\n```\n")
    for what in upstream_fixed:
        print(f"e2e: NOTICE: {what}: pristine sglang survived the injected misses: upstream fixed it")
        if os.environ.get("GITHUB_ACTIONS") == "true":
            print(f"::notice title=upstream fixed it::{what}: pristine survived the injected misses")
    print("\n".join(lines))
    return 0 if runs and all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
