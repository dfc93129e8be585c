"""One HTTP request's generation: its sequences on one engine rank, turned into text deltas.

A request has `len(prompts) * n` sequences (choices), all sent to one rank (the pool picks it) so a shared
prompt is prefilled once (admission control may refuse it first: a 503 with Retry-After, nothing sent). Outputs
arrive on one queue; each is detokenized, checked for stop strings (a hit finishes the sequence and aborts it on
the engine) and handed to the endpoint as `SeqDelta`s. An ERROR with a `retry_reason` (it waited longer than
--max-queue-time-s in the engine's queue, or the drain ran out) is a 503 with Retry-After too. `close()` aborts
whatever is still running: it runs when the client goes away, on errors and on shutdown. A generation uses the
pool, the tokenizer and the metrics it is given, nothing else of the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from dpserve_shared.schema import EngineRequest, FinishReason, RequestOutput, TokenLogprob

from dpserve_frontend.detokenizer import IncrementalDetokenizer
from dpserve_frontend.engine_pool import EnginePool
from dpserve_frontend.errors import EngineError, RetryLater, ServiceUnavailable
from dpserve_frontend.metrics import FrontendMetrics
from dpserve_frontend.router import NoEngineAvailable, QueuesFull, RankNotServing
from dpserve_frontend.spec import GenerationSpec
from dpserve_frontend.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sequence:
    index: int  # the choice index: prompt_index * n + child
    prompt_index: int
    request_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    queue_time_s: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text


@dataclasses.dataclass(slots=True)
class SeqDelta:
    seq: Sequence
    text: str
    num_tokens_before: int  # index in seq.token_ids of this delta's first token
    num_tokens: int
    finish_reason: str | None = None

    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.num_tokens_before : self.num_tokens_before + self.num_tokens]

    def logprobs(self) -> list[TokenLogprob]:
        return self.seq.logprobs[self.num_tokens_before : self.num_tokens_before + self.num_tokens]


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Generation:
    def __init__(self, pool: EnginePool, tokenizer: ModelTokenizer, metrics: FrontendMetrics, spec: GenerationSpec,
                 request_id: str, arrival_s: float | None = None):
        self._pool = pool
        self._metrics = metrics
        self.spec = spec
        self.request_id = request_id
        self.rank = -1
        self._queue: asyncio.Queue = asyncio.Queue()
        self._arrival_s = arrival_s if arrival_s is not None else time.perf_counter()  # for TTFT / e2e
        self._is_closed = False
        self._itls: list[float] = []  # inter-token gaps not yet observed (the histogram is fed per request)
        self.seqs: list[Sequence] = []
        for p, prompt in enumerate(spec.prompts):
            for child in range(spec.n):
                detok = IncrementalDetokenizer(
                    tokenizer.tokenizer,
                    prompt.token_ids,
                    skip_special_tokens=spec.skip_special_tokens,
                    stop=spec.stop,
                    include_stop_str_in_output=spec.include_stop_str_in_output,
                    min_tokens=spec.sampling.min_tokens,
                )
                self.seqs.append(Sequence(len(self.seqs), p, f"{request_id}-{p}-{child}", detok))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.spec.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        # Per prompt, what its first sequence reported (the prompt is counted once, like its tokens).
        return sum(s.num_cached_tokens for s in self.seqs if s.index % self.spec.n == 0)

    def start(self) -> None:
        """Send the sequences; the pool routes them (all to one rank) and `self.rank` is where they went."""
        arrival_time = time.time()
        requests = []
        for seq in self.seqs:
            sampling = self.spec.sampling
            child = seq.index % self.spec.n
            if sampling.seed is not None and child:
                # Children of a seeded request differ, and each is reproducible (vLLM's rule).
                sampling = msgspec.structs.replace(sampling, seed=_wrap_int64(sampling.seed + child))
            prompt = self.spec.prompts[seq.prompt_index]
            requests.append(EngineRequest(seq.request_id, prompt.token_ids, sampling, arrival_time=arrival_time))
        try:
            self.rank = self._pool.submit(requests, self._queue, self.spec.pinned_rank, self.spec.session_id)
        except (NoEngineAvailable, RankNotServing) as e:
            self._metrics.requests_failed.labels("no_rank").inc()
            raise ServiceUnavailable(str(e)) from None
        except QueuesFull as e:
            self._metrics.admission_rejections.labels(e.reason).inc()
            raise RetryLater(str(e), e.reason) from None

    async def deltas(self) -> AsyncIterator[list[SeqDelta]]:
        """Yields the deltas of each batch of engine outputs until every sequence finished."""
        num_unfinished = sum(not s.is_finished for s in self.seqs)
        queue = self._queue
        seqs = self.seqs
        apply = self._apply
        while num_unfinished:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            now = time.perf_counter()  # one clock read per batch: these outputs arrived together
            batch = []
            for seq_index, output in items:
                seq = seqs[seq_index]
                if seq.finish_reason is not None:
                    continue
                delta = apply(seq, output, now)
                if delta.finish_reason is not None:
                    num_unfinished -= 1
                if delta.text or delta.num_tokens or delta.finish_reason:
                    batch.append(delta)
            if batch:
                yield batch
        self._finish_metrics()

    def _apply(self, seq: Sequence, output: RequestOutput, now: float | None = None) -> SeqDelta:
        if now is None:
            now = time.perf_counter()
        finish_reason = output.finish_reason
        if finish_reason is not None and (finish_reason == FinishReason.ERROR or finish_reason == FinishReason.ABORT):
            self.close()
            if output.retry_reason is not None:
                self._count_retry(output.retry_reason)
                raise RetryLater(output.error or "retry later", output.retry_reason)
            self._metrics.engine_errors.labels(str(self.rank)).inc()
            self._metrics.requests_failed.labels("engine").inc()
            reason = output.error or "the engine aborted the request"
            raise EngineError(f"request failed on engine rank {self.rank}: {reason}")
        if seq.first_token_s is None:
            seq.num_cached_tokens = output.num_cached_tokens
            seq.queue_time_s = output.queue_time_s
            seq.prompt_logprobs = output.prompt_logprobs
        token_ids = seq.token_ids
        num_before = len(token_ids)
        detok = seq.detokenizer
        new_token_ids = output.new_token_ids
        if new_token_ids:
            new_logprobs = output.new_logprobs
            if new_logprobs is None:
                token_ids.extend(new_token_ids[: detok.add_tokens(new_token_ids)])
            else:
                for i, token_id in enumerate(new_token_ids):
                    token_ids.append(token_id)
                    if i < len(new_logprobs):
                        seq.logprobs.append(new_logprobs[i])
                    detok.add_token(token_id)
                    if detok.is_stopped:
                        break
            if seq.first_token_s is None:
                seq.first_token_s = now
            elif seq.last_token_s is not None:
                self._itls.append(now - seq.last_token_s)
            seq.last_token_s = now
        if detok.is_stopped:
            seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            if finish_reason is None:
                self._pool.abort([seq.request_id])
        elif finish_reason is not None:
            detok.finish()
            if detok.is_stopped:  # the released tail completed a stop string
                seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            else:
                seq.finish_reason, seq.stop_reason = finish_reason.value, output.stop_reason
        text = detok.take_new_text(seq.finish_reason is not None)
        return SeqDelta(seq, text, num_before, len(token_ids) - num_before, seq.finish_reason)

    def _count_retry(self, reason: str) -> None:
        if reason == "shutting_down":  # accepted, then cut off by the drain's end
            self._metrics.requests_failed.labels("shutdown").inc()
        else:
            self._metrics.admission_rejections.labels(reason).inc()

    def _flush_itls(self) -> None:
        if self._itls:
            itls, self._itls = self._itls, []
            self._metrics.observe_itls(self.rank, itls)

    def _finish_metrics(self) -> None:
        metrics = self._metrics
        self._flush_itls()
        metrics.count_prompt(self.rank, self.num_prompt_tokens)
        for seq in self.seqs:
            metrics.observe_finished(
                self.rank, seq.finish_reason or "abort", len(seq.token_ids), self._arrival_s,
                seq.first_token_s, seq.last_token_s, seq.queue_time_s,
            )
        if not log.isEnabledFor(logging.DEBUG):
            return
        first = self.seqs[0]
        ttft = f"{first.first_token_s - self._arrival_s:.3f}" if first.first_token_s is not None else "-"
        log.debug(
            "request %s finished on rank %d: %d seqs (%s), prompt %d, completion %d, cached %d tokens, "
            "ttft %s s, e2e %.3f s",
            self.request_id, self.rank, len(self.seqs), ",".join(sorted({s.finish_reason or "?" for s in self.seqs})),
            self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens, ttft,
            time.perf_counter() - self._arrival_s,
        )

    def close(self) -> None:
        """Abort every unfinished sequence on its engine (idempotent)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._flush_itls()  # what an unfinished request measured still counts
        unfinished = [s.request_id for s in self.seqs if not s.is_finished]
        if unfinished and self.rank >= 0:
            self._pool.abort(unfinished)
            self._metrics.aborted.inc(len(unfinished))
            log.debug("request %s: aborted %d unfinished sequences", self.request_id, len(unfinished))


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63
