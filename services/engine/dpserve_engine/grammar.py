"""Structured outputs in the engine: llguidance matchers that hold a request's tokens to its grammar.

The frontend turns response_format / structured outputs into an llguidance grammar (`SamplingParams.grammar`)
and validates it against the model's tokenizer; the engine holds what changes with every token. A constrained
request's path through an engine core (EngineCore and the null engine alike):

1. `add_request`: `PendingGrammars.add` compiles its matcher on a small thread pool (`GrammarCompiler`), and the
   request waits there, outside the scheduler's FIFO, so that a slow compile holds up no request behind it. A
   migrated continuation's earlier output tokens are replayed into the new matcher there too.
2. Every step: `take_done` hands over the compiled ones (they join the FIFO's end) and ends the failed ones, and
   those still compiling after --grammar-compile-timeout-s, as ERROR outputs.
3. Sampling: each constrained row's matcher fills its row of an [N, ceil(V/32)] int32 bitmask (one bit per
   token; many rows at once on llguidance's threads), which `disallowed_tokens` unpacks into the mask that sets
   the logits of forbidden tokens to -inf before anything else chooses a token. Rows without a grammar pass
   unchanged; a batch without one builds nothing.
4. `GrammarMatcher.consume` advances the matcher past each accepted token; once it is stopped (the grammar is
   complete and allows nothing but EOS), the request finishes with "stop".

A preempted sequence keeps its matcher: it is recomputed, its tokens unchanged.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

import llguidance
import numpy as np
from dpserve_shared.schema import EngineRequest, FinishReason, RequestOutput, SamplingParams
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from dpserve_engine.interface import InvalidRequest

COMPILE_THREADS = 2  # compiles share the cores with the steps; llguidance's compiles take ~1 ms, its fuel caps them
CACHE_SIZE = 64  # compiled grammars kept (repeated schemas: the common case of an API's structured outputs)
PENDING_WAIT_S = 0.005  # how long a step with nothing else to run waits for a compile (no busy spin)

T = TypeVar("T")


class GrammarError(Exception):
    """A grammar the engine cannot serve; the message is the request's error text."""


def check_params(params: SamplingParams) -> None:
    """InvalidRequest for settings a grammar contradicts (the frontend answers 400 for them first)."""
    clashing = [name for name in ("min_tokens", "ignore_eos") if getattr(params, name)]
    if clashing:
        raise InvalidRequest(
            f"{' and '.join(clashing)} cannot be combined with a grammar (structured outputs): the grammar decides "
            "where the output may end"
        )


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] ([N, ceil(V/32)] int32, bit t % 32 of word t // 32)."""
        fill_next_token_bitmask(self._matcher, bitmask, row)

    def allowed_token_ids(self) -> np.ndarray:
        """The token ids the grammar allows next, ascending (the null engine draws among them)."""
        bitmask = np.empty((1, num_words(self.vocab_size)), dtype=np.int32)
        self.fill(bitmask, 0)
        return np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: self.vocab_size])

    def consume(self, token_id: int) -> FinishReason | None:
        """Advance past an accepted token (not EOS: that ends the request first). STOP once the grammar is complete,
        ERROR if the token broke it (the mask rules that out; `error` says what happened), else None."""
        if not self._matcher.consume_token(token_id):
            return FinishReason.ERROR
        return FinishReason.STOP if self._matcher.is_stopped() else None

    @property
    def error(self) -> str:
        return f"the output left its grammar: {self._matcher.get_error()}"


def num_words(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


_executors: dict[int, llguidance.LLExecutor] = {}


def _executor(num_threads: int) -> llguidance.LLExecutor:
    """llguidance's pool for filling many rows' masks at once (one per thread count, made on first use)."""
    if num_threads not in _executors:
        _executors[num_threads] = llguidance.LLExecutor(num_threads)
    return _executors[num_threads]


def disallowed_tokens(rows: list[tuple[int, GrammarMatcher]], num_rows: int, vocab_size: int,
                      num_threads: int = 1) -> np.ndarray:
    """[num_rows, V] bool, True where the row's grammar forbids the token: rows[i] = (row, its matcher); the other
    rows forbid nothing. Several rows fill on `num_threads` threads (the step's own: its cores wait while it
    samples). (Unpacked bytewise, low bit first: the int32 words as a little-endian host lays them out.)"""
    bitmask = np.full((num_rows, num_words(vocab_size)), -1, dtype=np.int32)
    if len(rows) > 1 and num_threads > 1:
        fill_next_token_bitmask_par(_executor(num_threads), [(m._matcher, row) for row, m in rows], bitmask)
    else:
        for row, matcher in rows:
            matcher.fill(bitmask, row)
    return np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(np.bool_)


class GrammarCompiler:
    """Builds matchers for one engine's tokenizer, on a thread pool.

    The llguidance tokenizer is built from ModelInfo's tokenizer.json on the first compile (~0.25 s, once per
    engine: an engine that never sees a grammar never pays it). A compiled grammar is an LLMatcher in its initial
    state; the last CACHE_SIZE are kept, and a request's matcher is a copy of one (microseconds). A grammar that
    fails to compile is kept too (its matcher is in an error state for good), so a repeat fails as fast. Requests
    that bring a new grammar at the same moment may each compile it, COMPILE_THREADS at most: cheaper than making
    them wait on each other.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's logits width: the bitmask covers every id it can sample
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.tokenizer_error: str | None = None  # the tokenizer could not be built: no grammar can be served
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._executor = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def submit(self, grammar: str, replay: list[int]) -> concurrent.futures.Future[GrammarMatcher]:
        """A matcher for `grammar` that has consumed `replay` (a continuation's earlier output tokens); the future
        fails with GrammarError."""
        return self._executor.submit(self._compile, grammar, replay)

    def _compile(self, grammar: str, replay: list[int]) -> GrammarMatcher:
        tokenizer = self._load_tokenizer()
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # log_level 0: no stderr lines
            with self._lock:
                self._cache[grammar] = compiled
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        matcher = compiled.deep_copy()  # the cached one is never advanced
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        if replay and not matcher.consume_tokens(replay):
            raise GrammarError(f"the continuation's {len(replay)} earlier output tokens do not satisfy its grammar: "
                               f"{matcher.get_error()}")  # fmt: skip
        return GrammarMatcher(matcher, self.vocab_size)

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None and self.tokenizer_error is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                             eos_token=self._eos_token_ids or None)  # fmt: skip
                except ValueError as e:  # e.g. a null engine's placeholder ModelInfo
                    self.tokenizer_error = ("structured outputs need the model's tokenizer, which llguidance could "
                                            f"not load from its tokenizer.json: {e}")
        if self._tokenizer is None:
            raise GrammarError(self.tokenizer_error)
        return self._tokenizer


class PendingGrammars(Generic[T]):
    """The requests whose matcher is compiling (T: the engine's own request state), in arrival order."""

    def __init__(self, compiler: GrammarCompiler, timeout_s: float):
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._pending: dict[str, tuple[T, concurrent.futures.Future[GrammarMatcher], float]] = {}

    def check(self, params: SamplingParams) -> None:
        """InvalidRequest for a grammar request this engine can never serve."""
        check_params(params)
        if self.compiler.tokenizer_error is not None:
            raise InvalidRequest(self.compiler.tokenizer_error)

    def add(self, request: EngineRequest, item: T) -> None:
        """Compile request's grammar; a continuation's matcher replays its earlier output tokens (the last
        num_generated of its prompt), so that the constraint goes on where it was."""
        prompt = request.prompt_token_ids
        future = self.compiler.submit(request.sampling.grammar, prompt[len(prompt) - request.num_generated :])
        self._pending[request.request_id] = (item, future, time.monotonic() + self.timeout_s)

    def drop(self, request_id: str) -> T | None:
        """Forget a request (aborted); its compile runs on if it started, and is cached."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return None
        entry[1].cancel()
        return entry[0]

    def wait(self) -> None:
        """Until a compile ends, PENDING_WAIT_S at most: a step with nothing else to do does not spin."""
        concurrent.futures.wait([f for _, f, _ in self._pending.values()], PENDING_WAIT_S,
                                concurrent.futures.FIRST_COMPLETED)  # fmt: skip

    def take_done(self) -> tuple[list[tuple[T, GrammarMatcher]], list[RequestOutput]]:
        """(the compiled requests with their matchers, ERROR outputs for the failed and the timed-out ones)."""
        ready, failed = [], []
        now = time.monotonic()
        for request_id, (item, future, deadline) in list(self._pending.items()):
            if future.done():
                error = future.exception()
                if error is None:
                    ready.append((item, future.result()))
                else:
                    failed.append(error_output(request_id, _failure_text(error)))
            elif now > deadline:
                future.cancel()
                failed.append(error_output(request_id, f"the grammar did not compile within "
                                                       f"--grammar-compile-timeout-s {self.timeout_s:g} s"))
            else:
                continue
            del self._pending[request_id]
        return ready, failed

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def __iter__(self) -> Iterator[T]:
        return (item for item, _, _ in self._pending.values())


def _failure_text(error: BaseException) -> str:
    if isinstance(error, GrammarError):
        return str(error)
    return f"compiling the grammar failed: {type(error).__name__}: {error}"


def error_output(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=error)
