"""EngineCore: the real engine. Pure and in-process: add requests, step, read outputs; no sockets.

Expert parallelism (an MoE model with --enable-expert-parallel; interface.py's contract, the service's
lockstep.py): the engine is built before it knows its place in the group (the coordinator sends the ExpertGroup
after every rank registered), so it loads everything but the experts and holds none of them at first (its KV
cache is sized by --kv-cache-memory / --num-kv-blocks alone, as for any model, and reported at registration).
`set_expert_comm(comm)` is the moment it learns rank r of N: it loads the experts moe.expert_range(E, r, N) from
the checkpoint and runs its MoE layers over `comm` from then on. Called again with another (rank, world size), it
re-shards: experts it still needs stay, the others are dropped, the new ones are read from the checkpoint
(`set_expert_comm(None)`: all experts, local). While it has a comm, every `step()` runs exactly one forward
through the MoE layers (a step that schedules nothing runs `dummy_step()`'s zero-row forward), so that the ranks'
collectives match one for one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import torch
from dpserve_shared.schema import CpuChoice, EngineLoad, EngineRequest, FinishReason, ModelInfo, RequestOutput
from dpserve_shared.timing import MAX_LOGPROBS

from dpserve_engine.block_manager import BlockManager
from dpserve_engine.grammar import GrammarCompiler, PendingGrammars
from dpserve_engine.interface import EngineCoreBase, InvalidRequest, queue_timeout_output
from dpserve_engine.model import Precision, Transformer, build_model
from dpserve_engine.model_info import load_model_info
from dpserve_engine.model_runner import ModelRunner, StepResult
from dpserve_engine.moe import ExpertComm, expert_range
from dpserve_engine.scheduler import ScheduledBatch, Scheduler
from dpserve_engine.sequence import Sequence
from dpserve_engine.settings import EngineConfig, export_inductor_cache_dir
from dpserve_engine.step_rates import StepRates

logger = logging.getLogger(__name__)


def pick_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class EngineCore(EngineCoreBase):
    """Continuous batching over a paged KV cache (see scheduler.py for the algorithm)."""

    def __init__(self, config: EngineConfig, model: Transformer | None = None, model_info: ModelInfo | None = None):
        self.config = config
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({config.max_num_seqs}): every running request needs a token of budget per step"
            )
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        export_inductor_cache_dir(config)  # before anything touches inductor (loading the int4 weights does)
        if model_info is None:
            model_info = load_model_info(config)
        if model is None:
            model = load_model(config)
        self.model_info = model_info
        self.num_experts = model.args.num_experts  # the coordinator refuses a group size that does not divide it
        self.kv_blocks_total = self._num_kv_blocks(config, model)
        self.block_size = config.block_size
        self.block_manager = BlockManager(self.kv_blocks_total, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv_blocks_total, config.block_size, model_info.eos_token_ids)
        if not config.enforce_eager and self.runner.device.type == "cpu":
            self.runner.compile_decode(config.cache_dir, background=config.compile_in_background)
        if config.populate_kv_cache:
            self.runner.populate_kv_cache()
        self.eos_token_ids = frozenset(model_info.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        # structured outputs: sequences whose grammar compiles, outside the scheduler until it has (grammar.py)
        compiler = GrammarCompiler(model_info.tokenizer_json, model.args.vocab_size, model_info.eos_token_ids)
        self.grammars: PendingGrammars[Sequence] = PendingGrammars(compiler, config.grammar_compile_timeout_s)
        self.num_arrivals = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0  # computed (prefilled) prompt tokens, cumulative
        self.num_generation_tokens = 0
        self.rates = StepRates()  # measured prefill / decode tokens per second (for routing)
        self.expert_comm: ExpertComm | None = None  # set_expert_comm: the MoE layers run across the ranks

    @classmethod
    def from_model(cls, config: EngineConfig, model: Transformer, model_info: ModelInfo) -> EngineCore:
        """An engine around an in-memory model (tests, benchmarks): no files read."""
        return cls(config, model=model, model_info=model_info)

    @staticmethod
    def _num_kv_blocks(config: EngineConfig, model: Transformer) -> int:
        if config.num_kv_blocks:
            return config.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(model.args, config.block_size, model.prec.kv)
        return max(1, int(config.kv_cache_memory_gib * 2**30) // per_block)

    # -- requests --------------------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        self._validate(request)
        seq = Sequence(request.request_id, request.prompt_token_ids, request.sampling, self.num_arrivals,
                       request.num_generated)  # fmt: skip
        seq.arrival_s = time.monotonic()
        self.num_arrivals += 1
        self.requests[request.request_id] = seq
        if request.sampling.grammar is None:
            self.scheduler.add(seq)
        else:
            self.grammars.add(request, seq)

    def _validate(self, request: EngineRequest) -> None:
        prompt, params = request.prompt_token_ids, request.sampling
        max_len = self.model_info.max_model_len
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if request.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        if len(prompt) + params.max_tokens > max_len:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{len(prompt) + params.max_tokens} tokens, more than max_model_len ({max_len})"
            )
        vocab = self.runner.model.args.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab})")
        if params.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and not 0 <= k <= min(vocab, MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be in [0, {min(vocab, MAX_LOGPROBS)}], got {k}")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or not 0 <= params.min_p <= 1:
            raise InvalidRequest("temperature must be >= 0, top_p in (0, 1], min_p in [0, 1]")
        blocks_needed = self.block_manager.num_blocks_for(len(prompt) + params.max_tokens)
        if blocks_needed > self.kv_blocks_total:
            raise InvalidRequest(
                f"prompt + max_tokens needs {blocks_needed} KV blocks; this engine has {self.kv_blocks_total}"
            )
        if params.grammar is not None:
            self.grammars.check(params)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            seq = self.requests.pop(request_id, None)
            if seq is not None:
                self.grammars.drop(request_id)
                self.scheduler.finish(seq)
                outputs.append(RequestOutput(request_id, finish_reason=FinishReason.ABORT))
        return outputs

    @property
    def device(self) -> torch.device:
        """Where the model runs (the expert-parallel group is nccl on CUDA, gloo on CPU)."""
        return self.runner.device

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or len(self.grammars) > 0

    def start_kv_events(self) -> None:
        if self.config.enable_prefix_caching:
            self.block_manager.start_kv_events()

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        return self.block_manager.take_kv_events()

    def kv_snapshot(self) -> list[int]:
        return self.block_manager.cached_hashes()

    def cpu_choice(self) -> CpuChoice | None:
        if self.runner.device.type != "cpu":
            return None
        from dpserve_engine import cpu_paths

        cpu, paths = cpu_paths.detect(), self.runner.model.kernel_paths
        if paths is None:
            return CpuChoice(cpu.kind, cpu.model_name, "", "not a quantized GGUF model: dequantized weights")
        return CpuChoice(paths.cpu_kind, cpu.model_name, paths.path,
                         paths.reason + (f" (not exact: {paths.caveat})" if paths.caveat else ""))  # fmt: skip

    # -- expert parallelism ----------------------------------------------------------------------------------

    @property
    def supports_expert_parallel(self) -> bool:
        return self.runner.model.args.is_moe

    def set_expert_comm(self, comm: ExpertComm | None) -> None:
        """Run the MoE layers over `comm` (rank r of N), holding exactly the experts expert_range(E, r, N): the
        first call loads them, a later one with another (r, N) re-shards (None: all experts, locally)."""
        model = self.runner.model
        if not model.args.is_moe:
            super().set_expert_comm(comm)  # raises: a dense model has no experts to share
        num_experts = model.args.num_experts
        wanted = list(range(num_experts) if comm is None else expert_range(num_experts, comm.rank, comm.world_size))
        if model.expert_ids != wanted:
            self._reshard(wanted)
        model.set_expert_comm(comm)
        self.expert_comm = comm
        where = "locally" if comm is None else f"as rank {comm.rank} of {comm.world_size}"
        logger.info("MoE layers run %s, holding experts %s of %d (%.1f MiB of expert weights); KV cache %d blocks "
                    "of %d tokens", where, _ranges(wanted), num_experts, model.expert_weight_bytes / 2**20,
                    self.kv_blocks_total, self.block_size)  # fmt: skip

    def _reshard(self, wanted: list[int]) -> None:
        """Hold exactly `wanted`: keep the experts held already, read the others from the checkpoint, drop the rest."""
        from dpserve_engine.loader import load_weights

        model = self.runner.model
        held = model.expert_ids
        new = [e for e in wanted if e not in held]
        started = time.perf_counter()
        _, state = load_weights(self.config.model, self.config.cache_dir, None, expert_ids=new) if new else (None, {})
        model.set_experts(wanted, state)
        del state
        logger.info("experts re-sharded in %.2f s: loaded %s from %s, dropped %s", time.perf_counter() - started,
                    _ranges(new), self.config.model, _ranges([e for e in held if e not in wanted]))  # fmt: skip

    def dummy_step(self) -> None:
        """A forward of zero rows through every MoE layer (the same collectives as a step), for a lock-step rank
        with no requests while the others step."""
        if not self.runner.model.args.is_moe:
            super().dummy_step()  # raises
        self.runner.model.dummy_forward()

    def _check_experts_held(self) -> None:
        model = self.runner.model
        if self.expert_comm is None and model.args.is_moe and len(model.expert_ids) < model.args.num_experts:
            raise RuntimeError(
                f"this engine holds experts {_ranges(model.expert_ids)} of {model.args.num_experts} (expert "
                "parallel) but has no expert-parallel group yet: set_expert_comm() comes before the first step"
            )

    # -- step ------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._check_experts_held()
        failed = self._admit_compiled() if len(self.grammars) else []
        expired = self._expire_queued() if self.config.max_queue_time_s is not None else []
        batch = self.scheduler.schedule()
        if not batch:
            if self.expert_comm is not None:  # lock-step: the other ranks' MoE layers wait for this one's rows
                self.dummy_step()
            return failed + expired
        started = time.perf_counter()
        result = self.runner.run(batch)
        num_decode_tokens = batch.num_decodes
        self.rates.record(sum(batch.num_tokens) - num_decode_tokens, num_decode_tokens, time.perf_counter() - started)
        return failed + expired + self._postprocess(batch, result)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Sequences whose grammar compiled join the scheduler's queue; the failed ones end (their outputs). With
        nothing else to run, wait a little for a compile first: the service steps without pause meanwhile."""
        if not self.scheduler.has_unfinished():
            self.grammars.wait()
        ready, failed = self.grammars.take_done()
        for seq, matcher in ready:
            seq.matcher = matcher
            self.scheduler.add(seq)
        for output in failed:
            del self.requests[output.request_id]
        return failed

    def _expire_queued(self) -> list[RequestOutput]:
        """--max-queue-time-s: end the requests that waited longer than that without being scheduled."""
        now = time.monotonic()
        limit_s = self.config.max_queue_time_s
        outputs = []
        for seq in self.scheduler.take_expired(now - limit_s):
            del self.requests[seq.request_id]
            outputs.append(queue_timeout_output(seq.request_id, now - seq.arrival_s, limit_s))
        return outputs

    def _postprocess(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Advance computed counts, append sampled tokens, detect finishes, build this step's outputs."""
        self.num_steps += 1
        outputs = []
        for seq, num_tokens, token_id, logprob, prompt_logprobs in zip(
            batch.seqs, batch.num_tokens, result.token_ids, result.logprobs, result.prompt_logprobs
        ):
            if seq.num_output_tokens == 0:
                self.num_prompt_tokens += num_tokens
            seq.num_computed_tokens += num_tokens
            if prompt_logprobs:
                seq.prompt_logprobs.extend(prompt_logprobs)
            self.block_manager.cache_blocks(seq)
            if token_id is None:
                continue
            seq.token_ids.append(token_id)
            self.num_generation_tokens += 1
            self._check_finished(seq, token_id)
            outputs.append(self._output(seq, token_id, logprob))
        return outputs

    def _check_finished(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, token_id
            elif token_id in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = FinishReason.STOP
        if seq.finish_reason is None and seq.matcher is not None:
            seq.finish_reason = seq.matcher.consume(token_id)  # STOP once the grammar is complete
        if seq.finish_reason is None and (
            seq.num_output_tokens >= params.max_tokens or len(seq) >= self.model_info.max_model_len
        ):
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            del self.requests[seq.request_id]

    def _output(self, seq: Sequence, token_id: int, logprob) -> RequestOutput:
        output = RequestOutput(
            seq.request_id,
            [token_id],
            [logprob] if logprob is not None else None,
            seq.finish_reason,
            seq.stop_reason,
        )
        if seq.finish_reason == FinishReason.ERROR:  # only a grammar ends a running sequence so
            output.error = seq.matcher.error
        if seq.is_first_output:
            seq.is_first_output = False
            output.num_cached_tokens = seq.num_cached_tokens
            output.num_prompt_tokens = seq.num_prompt_tokens
            output.prompt_logprobs = seq.prompt_logprobs
            if seq.first_scheduled_s is not None and seq.arrival_s is not None:
                output.queue_time_s = seq.first_scheduled_s - seq.arrival_s
        return output

    def load(self) -> EngineLoad:
        waiting = [*self.scheduler.waiting, *self.grammars]
        return EngineLoad(
            rank=0,
            num_waiting=len(waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.kv_blocks_total,
            num_waiting_tokens=sum(s.num_uncomputed_tokens for s in waiting),
            step=self.num_steps,
            prefix_queries=self.block_manager.num_prefix_queries,
            prefix_hits=self.block_manager.num_prefix_hits,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            decode_compiled=self.runner.compiled is not None,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            decode_tokens_per_s=self.rates.decode_tokens_per_s,
            busy_s=self.rates.busy_s,
            max_num_seqs=self.scheduler.max_num_seqs,
        )


def load_model(config: EngineConfig, precision: Precision | None = None) -> Transformer:
    """The model `config` names. An MoE model with --enable-expert-parallel is loaded without any expert: the rank
    loads its own once it knows its place in the group (EngineCore.set_expert_comm)."""
    from dpserve_engine.loader import is_moe_model, load_weights

    device = pick_device(config)
    quantization = config.resolved_quantization(device.type)
    if quantization and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs CPU kernels; device is {device}")
    paths = choose_kernel_paths(config, quantization) if quantization else None
    path = paths.path if paths else None
    expert_ids = [] if config.enable_expert_parallel and is_moe_model(config.model) else None
    if expert_ids is not None:
        logger.info("expert parallel: loading no experts until this rank joins its group")
    args, state = load_weights(config.model, config.cache_dir, "int4" if path else None,  # 4-bit groups
                               expert_ids=expert_ids)  # fmt: skip
    prec = precision or Precision.for_device(device, config.dtype)
    if path:
        prec = Precision(torch.bfloat16, prec.act, prec.kv, prec.head)  # bf16: only placeholders before repacking
    logger.info("building model on %s: weights %s, activations %s", device, path or prec.weight, prec.act)
    model = build_model(args, state, prec, device, path or "int4", expert_ids)
    if args.is_moe:
        logger.info("MoE model: %d experts, top-%d; holding experts %s of %d (%.1f MiB of expert weights)",
                    args.num_experts, args.num_experts_per_tok, _ranges(model.expert_ids), args.num_experts,
                    model.expert_weight_bytes / 2**20)  # fmt: skip
    if path:
        logger.info("LM head: %s", model.quantize_head(path))
    model.kernel_paths = paths  # for benchmarks' records
    return model


def choose_kernel_paths(config: EngineConfig, quantization: str):
    """The kernel path for GGUF groups on this CPU (cpu_paths.py), logged with the CPU kind and the reason, and a
    warning when the path does not keep the README's promises there. Both paths use the engine's C++ kernels
    (built here, cached); without a C++ compiler only torch's "int4" kernels can run."""
    from dpserve_engine import cpu_paths, kernels

    cpu = cpu_paths.detect()
    forced = None if quantization == "auto" else quantization
    try:
        kernels.load(config.cache_dir)
    except Exception as e:  # noqa: BLE001 - e.g. no compiler: torch's own kernels still run
        chosen = cpu_paths.choose(cpu, "int4")
        chosen = dataclasses.replace(chosen, reason=f"the engine's C++ kernels could not be built ({e})")
    else:
        chosen = cpu_paths.choose(cpu, forced)
    masked = f", hiding {' '.join(sorted(cpu.masked))} ({cpu_paths.MASK_ENV})" if cpu.masked else ""
    logger.info("CPU %s, kind %s (torch %s; %s%s): kernel path %s, because %s: decode %s, prefill %s, LM head %s",
                cpu.model_name, chosen.cpu_kind, cpu.capability, " ".join(cpu.describe()["flags"]) or "no AVX2",
                masked, chosen.path, chosen.reason, chosen.decode, chosen.prefill, chosen.head)  # fmt: skip
    if chosen.caveat:
        logger.warning("kernel path %s trades exactness for speed on this CPU: %s", chosen.path, chosen.caveat)
    return chosen


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5' (for logs); 'none' when empty."""
    spans: list[list[int]] = []
    for e in ids:
        if spans and e == spans[-1][1] + 1:
            spans[-1][1] = e
        else:
            spans.append([e, e])
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in spans) or "none"
