"""End-to-end: a real sglang server on one GPU, HiCache on, a KV miss injected during a load.

    python ci/e2e/run_e2e.py --wheel dist/sglang-<V>+carry.<N>-*.whl --out build/e2e
        [--pristine-wheel upstream/.downloads/sglang-<V>-*.whl] [--models dense,hybrid]

Run with the line's GPU environment (ci/gpu-env: the official wheel's requirements with the
patched wheel installed). For each tiny model written here (no download: a dense Llama with
seeded random weights in safetensors, and a hybrid Qwen3.5 (Gated DeltaNet + attention) served
with --load-format dummy), three runs of `python -m sglang.launch_server` with
--skip-tokenizer-init, native HiCache (write-through), a tiny KV pool and no CUDA graphs:

- control: the patched wheel, no injection: every request finishes, host hits are seen;
- pristine: the official wheel (installed into its own folder, first on PYTHONPATH), misses
  injected: the scheduler dies with the allocation error. A pristine server that survives means
  upstream fixed the bug: this is reported (and the series entry can be dropped), not failed;
- patched: the patched wheel, misses injected: every request finishes, the unwind is logged, and
  the greedy outputs equal the control run's.

The miss is injected by hook/sitecustomize.py (CARRY_E2E_INJECT=1): the KV allocator returns
None inside prepare_for_extend while the batch's HiCache load is in flight, as an elastic pool
reports a miss. Traffic is bounded (rounds x prefix groups, each request with a timeout); the
server runs in its own process group on 127.0.0.1 and is killed by its PID's group. Prints a
table last; writes report.json, report.md and every server log to --out. Exit 0 when every run
met its expectation (a surviving pristine run included), 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).resolve().parent / "hook"
HOST = "127.0.0.1"

# Bounded traffic: GROUPS distinct prefixes of PREFIX_TOKENS each (together several times the L1
# pool, so the early ones are evicted to host), then ROUNDS - 1 more passes that share them
# (host hits: load back). Every request is greedy with MAX_NEW_TOKENS.
GROUPS = 8
PREFIX_TOKENS = 256
SUFFIX_TOKENS = 16
ROUNDS = 3
MAX_NEW_TOKENS = 8
CONCURRENCY = 4
VOCAB = 1024
REQUEST_TIMEOUT_S = 60
MISS_LIMIT = 3
STARTUP_TIMEOUT_S = 900
UNWIND_LOG = re.compile(r"Prefill allocation missed; unwound")
ALLOC_ERROR = re.compile(r"Out of memory|Prefill out of memory|alloc.*(failed|None)", re.IGNORECASE)

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
# Per model: the config, whether weights are written (else --load-format dummy), extra flags.
MODELS: dict[str, tuple[dict[str, Any], bool, list[str]]] = {
    "dense": (DENSE_LLAMA, True, []),
    "hybrid": (HYBRID_QWEN3_5, False, ["--load-format", "dummy", "--max-mamba-cache-size", "32"]),
}


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
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


def write_models(folder: Path, names: Sequence[str], seed: int = 0) -> dict[str, Path]:
    """One directory per model: config.json, and seeded random safetensors for the dense one."""
    dirs = {}
    for name in names:
        config, with_weights, _ = MODELS[name]
        model_dir = folder / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config, indent=2))
        (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
        if with_weights:
            import torch
            from safetensors.torch import save_file

            generator = torch.Generator().manual_seed(seed)
            tensors = {
                key: (
                    torch.ones(shape)
                    if key.endswith("norm.weight")
                    else torch.randn(shape, generator=generator) * 0.02
                ).to(torch.bfloat16)
                for key, shape in llama_weight_shapes(config).items()
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


def server_command(python: str, model_dir: Path, port: int, extra: Sequence[str] = ()) -> list[str]:
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
        "--enable-hierarchical-cache",
        "--hicache-write-policy",
        "write_through",
        "--hicache-ratio",
        "8",
        "--max-total-tokens",
        "1024",
        "--page-size",
        "1",
        "--max-running-requests",
        "8",
        "--chunked-prefill-size",
        "1024",
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
    key: str  # "round.group": the same key in two runs is the same prompt
    input_ids: list[int]


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


def generate(base_url: str, request: Request, timeout_s: float = REQUEST_TIMEOUT_S) -> Outcome:
    body = json.dumps(
        {
            "input_ids": request.input_ids,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
        }
    ).encode()
    http = urllib.request.Request(
        f"{base_url}/generate", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as response:
            answer = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as error:
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


def drive(base_url: str, waves: list[list[Request]], alive: Callable[[], bool]) -> list[Outcome]:
    """Send every wave (CONCURRENCY at a time), stopping early once the server is gone."""
    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        for wave in waves:
            if not alive():
                outcomes += [Outcome(r.key, False, error="server gone") for r in wave]
                continue
            outcomes += list(pool.map(lambda r: generate(base_url, r), wave))
    return outcomes


# --------------------------------------------------------------------------------------------
# One run and its verdict
# --------------------------------------------------------------------------------------------
@dataclass
class Run:
    model: str
    kind: str  # control | pristine | patched
    started: bool = False
    finished: int = 0
    failed: int = 0
    host_cached_tokens: int = 0
    injected_misses: int = 0
    loads_started: int = 0
    unwinds_logged: int = 0
    alloc_error_logged: bool = False
    server_died: bool = False
    outputs_equal_control: bool | None = None
    verdict: str = ""
    ok: bool = False
    seconds: float = 0.0
    log: str = ""


def read_counters(folder: Path) -> dict[str, int]:
    total: dict[str, int] = {}
    for path in sorted(folder.glob("*.json")):
        for key, value in json.loads(path.read_text()).items():
            total[key] = total.get(key, 0) + int(value)
    return total


def judge(run: Run, outcomes: list[Outcome], control: dict[str, list[int]] | None) -> None:
    """Set run.verdict / run.ok from what the run showed, against its kind's expectation."""
    run.finished = sum(o.ok for o in outcomes)
    run.failed = len(outcomes) - run.finished
    run.host_cached_tokens = sum(o.host_cached for o in outcomes)
    everything = run.failed == 0 and run.started
    if control is not None and everything:
        run.outputs_equal_control = all(o.output_ids == control.get(o.key) for o in outcomes)
    if run.kind == "control":
        run.ok = everything and run.host_cached_tokens > 0 and run.loads_started > 0
        run.verdict = (
            "all requests finished, host hits seen"
            if run.ok
            else f"{run.failed} failed, host-cached tokens {run.host_cached_tokens},"
            f" loads {run.loads_started}"
        )
    elif run.kind == "pristine":
        if run.injected_misses == 0:
            run.ok, run.verdict = False, "no miss was injected (no load in flight at an allocation)"
        elif run.server_died or run.failed:
            run.ok = run.alloc_error_logged
            run.verdict = (
                "the scheduler died with the allocation error (as expected)"
                if run.ok
                else "the server died, but without the allocation error in its log"
            )
        else:
            run.ok = True
            run.verdict = "UPSTREAM FIXED IT: pristine survived the injected misses (drop the unwind entries)"
    else:
        run.ok = bool(
            everything and run.injected_misses > 0 and run.unwinds_logged > 0 and run.outputs_equal_control
        )
        run.verdict = (
            "every request finished, the unwind was logged, outputs equal the control run's"
            if run.ok
            else (
                f"{run.failed} failed, misses {run.injected_misses}, unwinds logged {run.unwinds_logged},"
                f" outputs equal control: {run.outputs_equal_control}"
            )
        )


def run_once(
    model: str,
    kind: str,
    command: Sequence[str],
    out: Path,
    base_env: dict[str, str],
    pythonpath: Sequence[Path],
    control: dict[str, list[int]] | None,
    port: int,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> tuple[Run, list[Outcome]]:
    started_at = time.monotonic()
    run = Run(model, kind, log=f"{model}-{kind}.log")
    counters = out / "counters" / f"{model}-{kind}"
    env = dict(base_env)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(HOOK), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["CARRY_E2E_COUNTERS_DIR"] = str(counters)
    # The hook runs in every run (it counts the loads started); only the control run injects nothing.
    env["CARRY_E2E_INJECT"] = "1"
    env["CARRY_E2E_MISS_LIMIT"] = "0" if kind == "control" else str(MISS_LIMIT)
    server = Server.start(command, env, out / run.log, port)
    outcomes: list[Outcome] = []
    try:
        run.started = server.wait_healthy(startup_timeout_s)
        if run.started:
            outcomes = drive(server.base_url, plan_traffic(), server.alive)
            time.sleep(1.0)  # let a dying scheduler take the server down before we look
        run.server_died = not server.alive()
    finally:
        server.stop()
    text = (out / run.log).read_text(errors="replace")
    counts = read_counters(counters)
    run.injected_misses = counts.get("injected_misses", 0)
    run.loads_started = counts.get("loads_started", 0)
    run.unwinds_logged = len(UNWIND_LOG.findall(text))
    run.alloc_error_logged = bool(ALLOC_ERROR.search(text))
    if not run.started:
        outcomes = [
            Outcome(r.key, False, error="server never became healthy") for w in plan_traffic() for r in w
        ]
    judge(run, outcomes, control)
    run.seconds = time.monotonic() - started_at
    return run, outcomes


def install_pristine(python: str, wheel: Path, target: Path) -> Path:
    """The official wheel, unpacked into its own folder (first on the pristine run's PYTHONPATH)."""
    if not (target / "sglang").is_dir():
        subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
            check=True,
        )
    return target


def official_wheel_of(patched: Path) -> Path:
    """The upstream wheel a patched wheel was built from, in upstream/.downloads (its provenance)."""
    with zipfile.ZipFile(patched) as archive:
        name = next(n for n in archive.namelist() if n.endswith("sglang_carry_provenance.json"))
        upstream = json.loads(archive.read(name))["upstream"]["file"]
    return ROOT / "upstream" / ".downloads" / upstream


def table(runs: Sequence[Run]) -> list[str]:
    lines = [
        f"{'model':<7} {'run':<9} {'ok':<3} {'done':>5} {'fail':>4} {'host':>6} {'miss':>4}"
        f" {'unw':>4}  verdict"
    ]
    for r in runs:
        lines.append(
            f"{r.model:<7} {r.kind:<9} {'yes' if r.ok else 'NO':<3} {r.finished:>5} {r.failed:>4}"
            f" {r.host_cached_tokens:>6} {r.injected_misses:>4} {r.unwinds_logged:>4}  {r.verdict}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/e2e/run_e2e.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--wheel", type=Path, required=True, help="the patched wheel (installed in this venv)"
    )
    parser.add_argument(
        "--pristine-wheel", type=Path, help="the official wheel (default: from the provenance)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="dense,hybrid")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the servers")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.models.split(",") if n]
    pristine_wheel = args.pristine_wheel or official_wheel_of(args.wheel)
    pristine_site = install_pristine(args.python, pristine_wheel, out / "pristine-site")
    models = write_models(out / "models", names)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARRY_E2E_")}
    runs: list[Run] = []
    for name in names:
        _, _, extra = MODELS[name]
        control_outputs: dict[str, list[int]] | None = None
        for kind in ("control", "pristine", "patched"):
            port = free_port()
            command = server_command(args.python, models[name], port, extra)
            site = [pristine_site] if kind == "pristine" else []
            run, outcomes = run_once(name, kind, command, out, env, site, control_outputs, port)
            if kind == "control":
                control_outputs = {o.key: o.output_ids for o in outcomes if o.ok}
            runs.append(run)
            print(f"e2e: {name} {kind}: {run.verdict} ({run.seconds:.0f} s)", flush=True)
    report = {
        "runs": [asdict(r) for r in runs],
        "pristine_wheel": pristine_wheel.name,
        "wheel": args.wheel.name,
    }
    upstream_fixed = [
        r.model for r in runs if r.kind == "pristine" and r.verdict.startswith("UPSTREAM FIXED")
    ]
    report["upstream_fixed"] = upstream_fixed
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = table(runs)
    (out / "report.md").write_text("```\n" + "\n".join(lines) + "\n```\n")
    for model in upstream_fixed:
        print(f"e2e: NOTICE: {model}: pristine sglang survived the injected misses: upstream fixed it")
        if os.environ.get("GITHUB_ACTIONS") == "true":
            print(f"::notice title=upstream fixed it::{model}: pristine survived the injected misses")
    print("\n".join(lines))
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
