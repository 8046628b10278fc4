"""Grammar requests for the simulation: upstream's real `GrammarManager`, over a grammar backend
whose compilations finish when the test says.

The grammar backend is the I/O boundary (xgrammar's compiler, on a thread pool): `GatedBackend` is
upstream's `BaseGrammarBackend` (its cache, its thread pool, its futures), whose compilation of
each request's grammar waits on a gate the simulation opens at an iteration of each rank's own
(two GPUs' hosts compile at their own pace). Whether a request's grammar is ready is then each
rank's own reading, which upstream's `GrammarManager.get_ready_grammar_requests` makes alike over
the group (it all-gathers the ready and the timed-out requests). A compilation that is never let
finish on one rank times out there after `SGLANG_GRAMMAR_MAX_POLL_ITERATIONS` polls, and upstream
aborts it on every rank.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import scheduler_harness as sh
from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from sglang.srt.constrained.grammar_manager import GrammarManager

# How long a compilation waits for its gate, at most: only reached where a test is failing (the
# simulation opens every gate once its traffic is over).
GATE_BOUND_S = 120.0
# Polls (one per iteration while a grammar waits) before upstream gives a grammar up: low, so that
# a compilation the simulation never lets finish on one rank times out within a seed.
MAX_POLL_ITERATIONS = 12


class SimGrammar(BaseGrammarObject):  # type: ignore[misc]  # sglang is untyped
    """A compiled grammar that accepts every token and never terminates (the request ends at its
    max_new_tokens): what the scheduler calls of it, no vocabulary mask (the fixed-token forward
    samples nothing). Its repr is its state, as xgrammar's grammar object's is (upstream's
    rank-consensus checker compares requests by their repr)."""

    def __init__(self, key_string: str) -> None:
        super().__init__()
        self.key_string = key_string
        self.accepted_tokens: list[int] = []

    def accept_token(self, token: int) -> None:
        self.accepted_tokens.append(int(token))

    def is_terminated(self) -> bool:
        return False

    def copy(self) -> SimGrammar:
        return SimGrammar(self.key_string)

    def __repr__(self) -> str:
        return f"SimGrammar({self.key_string=}, {self.accepted_tokens=})"


class SchemaFutures(ThreadPoolExecutor):
    """The backend's thread pool, noting each compilation's future by its schema (upstream submits
    `_init_value_dispatch(key, ...)`, its key (kind, schema))."""

    def __init__(self, max_workers: int) -> None:
        super().__init__(max_workers=max_workers)
        self.by_schema: dict[str, Future[Any]] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        if args and isinstance(args[0], tuple) and len(args[0]) == 2:
            self.by_schema[str(args[0][1])] = future
        return future


class GatedBackend(BaseGrammarBackend):  # type: ignore[misc]  # sglang is untyped
    """Upstream's grammar backend, its compiler replaced: each JSON schema (one per request, named
    by it) compiles once its gate is open."""

    def __init__(self) -> None:
        super().__init__()
        # A thread for every request a seed sends: a compilation held at its gate must not keep
        # another, whose gate is open, waiting for a thread (the pool's size is not under test).
        self.executor = SchemaFutures(max_workers=32)
        self.gates: dict[str, threading.Event] = {}

    def gate(self, schema: str) -> threading.Event:
        return self.gates.setdefault(schema, threading.Event())

    def let_compile(self, schema: str) -> None:
        """Open the schema's gate and wait (bounded) until its compilation has finished, so the
        rank's next poll reads it ready whatever its thread's timing: a seed's iterations repeat
        on every run (upstream's poll reads `future.done()`, which a busy machine could otherwise
        leave false for one more iteration)."""
        self.gate(schema).set()
        future = self.executor.by_schema.get(schema)
        if future is not None:
            futures_wait([future], timeout=GATE_BOUND_S)

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        if not self.gate(key_string).wait(GATE_BOUND_S):
            raise TimeoutError(f"the grammar {key_string} was never let compile")
        return SimGrammar(key_string)

    def open_every_gate(self) -> None:
        for schema in list(self.gates):
            self.gate(schema).set()
        self.executor.shutdown(wait=False, cancel_futures=True)


def schema_of(rid: str) -> str:
    """The JSON schema a grammar request of the simulation asks for: its own."""
    return f'{{"title": "{rid}", "type": "object"}}'


def install(h: sh.Harness, ranks: int, rank: int) -> GatedBackend:
    """Upstream's GrammarManager, built by its own constructor over the harness's scheduler, with
    the gated backend. Its sync group is the harness's TP CPU group (the dp-tp group of a server
    without DP attention); the group's coordinator is given only what the constructor reads of it
    (its size and first rank). The harness skips the tokenizer, so the constructor creates no
    backend; the gated one is plugged in where `create_grammar_backend`'s would be."""
    s = h.scheduler
    s.dp_tp_cpu_group = s.tp_cpu_group
    s.dp_tp_group = types.SimpleNamespace(world_size=ranks, first_rank=0, is_first_rank=rank == 0)
    s.pp_group = getattr(s, "pp_group", None)
    manager = GrammarManager(s)
    manager.SGLANG_GRAMMAR_MAX_POLL_ITERATIONS = MAX_POLL_ITERATIONS
    backend = GatedBackend()
    manager.grammar_backend = backend
    s.grammar_manager = manager
    return backend


def submit(h: sh.Harness, req: Any) -> None:
    """A grammar request received (scheduler.handle_generate_request's last step): upstream's
    manager queues it until its grammar is ready, or hands it back to the waiting queue."""
    s = h.scheduler
    if not s.grammar_manager.process_req_with_grammar(req):
        s._add_request_to_queue(req)


def timed_out(req: Any) -> bool:
    """Whether upstream gave the request's grammar up (its poll count ran out) and aborted it."""
    return "Grammar preprocessing timed out" in str(getattr(req.finished_reason, "message", ""))
