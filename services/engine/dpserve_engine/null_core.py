"""The null engine: EngineCore's interface with no model.

A product feature, not a test double: it measures the frontend and coordinator alone (benchmarks) and lets a
simulation run many ranks on one machine. Each step takes `step_time_s` and gives every running request one
token; requests go from waiting to running up to `max_num_seqs`; with `max_queue_time_s` one that waited longer
than that is ended as EngineCore ends it (`interface.queue_timeout_output`).

Prefix cache (null_prefix_cache.py, with `enable_prefix_caching`): a request's prompt blocks are looked up when it
is admitted, and the step that admits it takes `prefill_time_per_token_s` longer per prompt token not cached, so
routing by prefix shows up in time to first token without a model. Its KV events and measured prefill/decode
rates are reported as the real engine's are.

Structured outputs (SamplingParams.grammar): compiled and held outside the queue as EngineCore does (grammar.py),
with a real llguidance matcher over the ModelInfo's tokenizer. Instead of its fixed tokens, such a request gets a
random token among those its grammar allows each step, from a `random.Random` of its own (seeded by its seed, else
by its request id: the same request gives the same text, and a continuation goes on with the draws it would have
had); it ends "stop" when its grammar is complete or it drew EOS where the grammar allowed it. So the frontend's
structured outputs can be fuzzed end to end without a model.

Expert-parallel mode (`set_expert_comm`, with --enable-expert-parallel): every step, and every dummy step of a
rank without requests, runs what an MoE model's forward would over the expert-parallel group, on small tensors:
NULL_EP_NUM_LAYERS layers of gather + scatter_sum, one row per sequence decoded in the step (0 in a dummy step),
before the step's tokens are generated (a failed exchange commits nothing). A new comm (a re-formed group) takes
over from the next step; the null engine has no experts to re-shard.
So the lock-step wave protocol (pause, restart, dummy steps, the all-reduce) runs for real across processes
without a model; torch is imported only in this mode.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Iterable

from dpserve_shared.schema import EngineLoad, EngineRequest, FinishReason, ModelInfo, RequestOutput

from dpserve_engine.grammar import GrammarCompiler, GrammarMatcher, PendingGrammars
from dpserve_engine.interface import EngineCoreBase, InvalidRequest, queue_timeout_output
from dpserve_engine.null_prefix_cache import NullPrefixCache
from dpserve_engine.step_rates import StepRates


NULL_EP_NUM_LAYERS = 2  # "MoE layers" per step in expert-parallel mode
_NULL_EP_DIM = 8  # their hidden size


class _NullRequest:
    __slots__ = ("request", "num_generated", "is_first", "arrival_s", "num_cached_tokens", "matcher", "rng")

    def __init__(self, request: EngineRequest):
        self.request = request
        self.num_generated = 0
        self.is_first = True
        self.arrival_s = time.monotonic()
        self.num_cached_tokens = 0
        self.matcher: GrammarMatcher | None = None  # a grammar request's, once compiled
        self.rng: random.Random | None = None  # a grammar request's draws among the allowed tokens
        if request.sampling.grammar is not None:
            seed = request.sampling.seed
            self.rng = random.Random(seed if seed is not None else request.request_id)  # a str seed: stable
            for _ in range(request.num_generated):  # a continuation: the draws its earlier tokens took
                self.rng.random()


class NullEngineCore(EngineCoreBase):
    def __init__(
        self,
        model_info: ModelInfo,
        step_time_s: float = 0.0,
        max_num_seqs: int = 256,
        token_ids: list[int] | None = None,
        num_kv_blocks: int = 4096,
        max_queue_time_s: float | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        prefill_time_per_token_s: float = 0.0,
        grammar_compile_timeout_s: float = 10.0,
    ):
        self.model_info = model_info
        self._max_queue_time_s = max_queue_time_s
        self.kv_blocks_total = num_kv_blocks
        self._step_time_s = step_time_s
        self._max_num_seqs = max_num_seqs
        # Ordinary text tokens; cycling through them gives readable output from any byte-level BPE vocab.
        self._token_ids = token_ids or [min(1000 + i, model_info.vocab_size - 1) for i in range(8)]
        self._waiting: collections.OrderedDict[str, _NullRequest] = collections.OrderedDict()
        self._running: collections.OrderedDict[str, _NullRequest] = collections.OrderedDict()
        compiler = GrammarCompiler(model_info.tokenizer_json, model_info.vocab_size, model_info.eos_token_ids)
        self._grammars: PendingGrammars[_NullRequest] = PendingGrammars(compiler, grammar_compile_timeout_s)
        self._eos_token_ids = frozenset(model_info.eos_token_ids)
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_steps = 0
        self.block_size = block_size
        self._prefix_cache = NullPrefixCache(num_kv_blocks, block_size) if enable_prefix_caching else None
        self._prefill_time_per_token_s = prefill_time_per_token_s
        self.rates = StepRates()
        self._expert_comm = None  # set_expert_comm: expert-parallel mode

    def set_expert_comm(self, comm) -> None:
        self._expert_comm = comm

    def dummy_step(self) -> None:
        self._exchange_with_experts(0)

    def _exchange_with_experts(self, num_rows: int) -> None:
        """What an MoE forward does across ranks: per layer, gather every rank's rows, "compute" (this rank's
        experts add its rank + 1), sum over ranks; checks that its own rows came back with every rank's share."""
        import torch  # expert-parallel mode only

        comm = self._expert_comm
        expected = sum(range(1, comm.world_size + 1))
        for _ in range(NULL_EP_NUM_LAYERS):
            x = torch.ones((num_rows, _NULL_EP_DIM))
            gathered, counts = comm.gather(x)
            mine = comm.scatter_sum(gathered * (comm.rank + 1), counts)
            if mine.shape != x.shape or (num_rows and not bool((mine == expected).all())):
                raise RuntimeError(f"expert-parallel exchange returned {tuple(mine.shape)} rows, not {num_rows}")

    def add_request(self, request: EngineRequest) -> None:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if not request.prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        if total > self.model_info.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(request.prompt_token_ids)} tokens) plus max_tokens ({request.sampling.max_tokens}) "
                f"exceeds max_model_len ({self.model_info.max_model_len})"
            )
        if any(request.request_id in d for d in (self._waiting, self._running, self._grammars)):
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        if request.sampling.grammar is None:
            self._waiting[request.request_id] = _NullRequest(request)
        else:
            self._grammars.check(request.sampling)
            self._grammars.add(request, _NullRequest(request))

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            entry = (self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
                     or self._grammars.drop(request_id))  # fmt: skip
            if entry is not None:
                outputs.append(RequestOutput(request_id, finish_reason=FinishReason.ABORT))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running) or len(self._grammars) > 0

    def _admit_compiled(self) -> list[RequestOutput]:
        """As EngineCore's: the compiled join the queue, the failed end; with nothing else to run, wait a little."""
        if not (self._waiting or self._running):
            self._grammars.wait()
        ready, failed = self._grammars.take_done()
        for entry, matcher in ready:
            entry.matcher = matcher
            self._waiting[entry.request.request_id] = entry
        return failed

    def _constrained_token(self, entry: _NullRequest) -> tuple[int, FinishReason | None]:
        """A random token among those the grammar allows, and the finish it makes (EOS, or the grammar complete)."""
        allowed = entry.matcher.allowed_token_ids()
        token_id = int(allowed[int(entry.rng.random() * len(allowed))])
        if token_id in self._eos_token_ids:
            return token_id, FinishReason.STOP
        return token_id, entry.matcher.consume(token_id)

    def _expire_queued(self) -> list[RequestOutput]:
        now = time.monotonic()
        limit_s = self._max_queue_time_s
        expired = []
        for request_id, entry in self._waiting.items():  # arrival order
            if now - entry.arrival_s <= limit_s:
                break
            if not entry.request.num_generated:  # a continuation is exempt
                expired.append(queue_timeout_output(request_id, now - entry.arrival_s, limit_s))
        for output in expired:
            del self._waiting[output.request_id]
        return expired

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        ended = self._admit_compiled() if len(self._grammars) else []  # grammars that failed to compile
        if self._max_queue_time_s is not None:
            ended += self._expire_queued()
        num_prefill_tokens = 0
        while self._waiting and len(self._running) < self._max_num_seqs:
            request_id, entry = self._waiting.popitem(last=False)
            self._running[request_id] = entry
            prompt = entry.request.prompt_token_ids
            if self._prefix_cache is not None:
                entry.num_cached_tokens = self._prefix_cache.admit(prompt)
            num_prefill_tokens += len(prompt) - entry.num_cached_tokens
        self._num_prompt_tokens += num_prefill_tokens
        if self._expert_comm is not None:
            # before any token: a failed exchange (a peer died) leaves every request as it was, to go on in the
            # re-formed group (lockstep.py)
            self._exchange_with_experts(len(self._running))
        outputs = []
        finished = []
        for request_id, entry in self._running.items():
            if entry.matcher is None:
                # by output position: a continuation (request.num_generated > 0) goes on with the tokens it would
                # have had
                token_id = self._token_ids[(entry.request.num_generated + entry.num_generated) % len(self._token_ids)]
                finish = None
            else:
                token_id, finish = self._constrained_token(entry)
            entry.num_generated += 1
            output = RequestOutput(request_id, [token_id])
            if entry.is_first:
                output.num_prompt_tokens = len(entry.request.prompt_token_ids)
                output.num_cached_tokens = entry.num_cached_tokens
                entry.is_first = False
            if finish is None and entry.num_generated >= entry.request.sampling.max_tokens:
                finish = FinishReason.LENGTH
            if finish is not None:
                output.finish_reason = finish
                if finish == FinishReason.ERROR:
                    output.error = entry.matcher.error
                finished.append(request_id)
            outputs.append(output)
        for request_id in finished:
            del self._running[request_id]
        self._num_generation_tokens += len(outputs)
        self._num_steps += 1
        step_s = self._step_time_s + self._prefill_time_per_token_s * num_prefill_tokens
        remaining = step_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        self.rates.record(num_prefill_tokens, len(outputs), time.perf_counter() - started)
        return ended + outputs if ended else outputs

    def start_kv_events(self) -> None:
        if self._prefix_cache is not None:
            self._prefix_cache.start_kv_events()

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        return self._prefix_cache.take_kv_events() if self._prefix_cache is not None else ([], [])

    def kv_snapshot(self) -> list[int]:
        return self._prefix_cache.cached_hashes() if self._prefix_cache is not None else []

    def load(self) -> EngineLoad:
        waiting = [*self._waiting.values(), *self._grammars]
        return EngineLoad(
            rank=0,
            num_waiting=len(waiting),
            num_running=len(self._running),
            kv_blocks_used=0,
            kv_blocks_total=self.kv_blocks_total,
            num_waiting_tokens=sum(len(e.request.prompt_token_ids) for e in waiting),
            step=self._num_steps,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
            prefix_queries=self._prefix_cache.num_queries if self._prefix_cache is not None else 0,
            prefix_hits=self._prefix_cache.num_hits if self._prefix_cache is not None else 0,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            decode_tokens_per_s=self.rates.decode_tokens_per_s,
            busy_s=self.rates.busy_s,
            max_num_seqs=self._max_num_seqs,
        )
