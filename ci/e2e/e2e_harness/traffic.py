"""What a run sends: the requests (waves of them, each request greedy and bounded), how they are
sent and what came back. One planner per kind of traffic; a Scenario (scenarios.py) names its
runs' planner.

The planners read the sizes below when they are called, so a test shrinks the traffic by setting
them on this module."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from .models import VOCAB

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
REQUEST_TIMEOUT_S = 60
# Natural traffic (scenarios.NATURAL, where the mechanism is told): one long prompt, chunked, and
# short prompts that arrive while it is.
NATURAL_LONG_TOKENS = 3000
NATURAL_SHORT_TOKENS = 48
NATURAL_SHORT_REQUESTS = 30
NATURAL_SHORT_AFTER_S = 0.1
# Parked-chunk traffic (scenarios.NATURAL_PARKED): one long prompt nearly the pool's size, and one
# short request that arrives while it is chunked and decodes long enough to fill the pool.
PARKED_LONG_TOKENS = 3280
PARKED_SHORT_NEW_TOKENS = 256


@dataclass
class Request:
    key: str  # e.g. "round.group": the same key in two runs is the same prompt (and its rid)
    input_ids: list[int]
    # Sent this long after its wave starts (every request of a wave is in flight at once).
    send_after_s: float = 0.0
    # Its greedy new tokens (None: MAX_NEW_TOKENS).
    max_new_tokens: int | None = None


@dataclass
class Outcome:
    key: str
    ok: bool
    output_ids: list[int] = field(default_factory=list)
    host_cached: int = 0
    # Read from HiCache's L3 tier (the server reports it only when the tier is on).
    storage_cached: int = 0
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


def plan_parked_traffic(seed: int = 0) -> list[list[Request]]:
    """One wave: the long prompt, then (NATURAL_SHORT_AFTER_S later, while it is chunked) one short
    prompt that decodes PARKED_SHORT_NEW_TOKENS."""
    rng = random.Random(seed)
    long = Request("long", [rng.randrange(3, VOCAB) for _ in range(PARKED_LONG_TOKENS)])
    short = Request(
        "short",
        [rng.randrange(3, VOCAB) for _ in range(NATURAL_SHORT_TOKENS)],
        NATURAL_SHORT_AFTER_S,
        max_new_tokens=PARKED_SHORT_NEW_TOKENS,
    )
    return [[long, short]]


def generate(base_url: str, request: Request, timeout_s: float = REQUEST_TIMEOUT_S) -> Outcome:
    time.sleep(request.send_after_s)
    body = json.dumps(
        {
            "input_ids": request.input_ids,
            "sampling_params": {
                "max_new_tokens": MAX_NEW_TOKENS
                if request.max_new_tokens is None
                else request.max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
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
        storage_cached=int(details.get("storage", 0) or 0),
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
