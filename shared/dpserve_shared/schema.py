"""The dpserve wire schema: every message that crosses a process boundary.

Messages are msgspec Structs, tagged (the tag is the first element of the msgpack array), positional
(`array_like=True`) with trailing defaults dropped (`omit_defaults=True`). Field order is part of the wire
format: append new fields at the end with a default, and bump PROTOCOL_VERSION for anything else.

They are grouped by where they go:

- ToEngine:      frontend -> engine ROUTER (requests, aborts), and a rank's CoreUse to the ranks on its node
- ToFrontend:    engine ROUTER -> frontend DEALER (EngineOutputs, EngineHello)
- ToCoordinator: frontend/engine DEALER -> coordinator control ROUTER
- FromCoordinator: control replies and PUB broadcasts (to frontends and engines alike)

Sockets and the request path are described in docs/architecture.md.
"""

from __future__ import annotations

import enum

import msgspec

# 2: WaveComplete, ReleaseRequests, prefix_block_hashes removed; 3: EngineRequest.num_generated; 4: lock-step waves
# (WaveComplete again, ExpertGroup, EngineLoad's lock-step counters)
PROTOCOL_VERSION = 5


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, tag=True, kw_only=False):
    """Base of every tagged wire message."""


class _Part(msgspec.Struct, array_like=True, omit_defaults=True):
    """Base of untagged parts nested inside messages."""


# ----------------------------------------------------------------------------------------------------------------
# Shared parts
# ----------------------------------------------------------------------------------------------------------------


class EngineState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id (the frontend also ends requests on stop strings)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the client / frontend
    ERROR = "error"  # the engine failed this request


class SamplingParams(_Part):
    """Per-request sampling. Defaults are OpenAI's / vLLM's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None  # same, for every prompt token but the first
    # A structured-output constraint: an llguidance grammar (the JSON text llguidance.LLMatcher.grammar_from_*
    # returns), which the frontend built and validated against the model's tokenizer; None: unconstrained.
    grammar: str | None = None


class ModelInfo(_Part):
    """What a frontend needs to serve a model without model files or torch."""

    name: str  # served model name
    root: str  # path or id the weights came from
    max_model_len: int
    vocab_size: int
    tokenizer_json: str  # tokenizers' JSON serialization
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False


class TokenLogprob(_Part):
    """Logprob of one chosen token plus its top alternatives (ids and logprobs, best first)."""

    token_id: int
    logprob: float
    rank: int = 1
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class EngineLoad(_Part):
    """An engine's load and cumulative counters at one step. Counters only ever grow."""

    rank: int
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_waiting_tokens: int = 0  # prompt tokens still to prefill (for token-aware routing)
    wave: int = 0
    is_running: bool = False  # engine is stepping (wave protocol)
    step: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, found
    prompt_tokens: int = 0  # prompt tokens computed (cumulative)
    generation_tokens: int = 0  # tokens generated (cumulative)
    num_preemptions: int = 0
    decode_compiled: bool = False  # decode steps run the compiled graph (False while it is prepared, or eager)
    # Measured: prompt tokens prefilled / decode tokens generated per second of step time (moving averages; 0 =
    # not measured yet). The cache-aware router's cost divides by them (frontend routing_cost.py).
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    # Set by the coordinator on a LoadSnapshot: requests (and their prompt tokens) that API servers routed to the
    # rank and its engine has not reported receiving yet (coordinator reservations.py).
    num_reserved: int = 0
    num_reserved_tokens: int = 0
    busy_s: float = 0.0  # seconds spent in steps since the engine started (cumulative)
    max_num_seqs: int = 0  # its batch's capacity (--max-num-seqs; 0: unknown)
    # Lock-step (--enable-expert-parallel) only: steps run with no request of this rank's own (so that the
    # collectives of the busy ranks match), and seconds spent in the expert-parallel group's collectives.
    num_dummy_steps: int = 0
    collective_time_s: float = 0.0


class FrontendStats(_Part):
    """One API server's own figures, on its heartbeats and, gathered by the coordinator, on every LoadSnapshot
    (the status page's API-server panel and its TTFT/TPOT charts). Counters are cumulative since its start."""

    frontend_id: str
    pid: int = 0
    http_addr: str = ""
    num_in_flight: int = 0  # HTTP requests being answered
    requests_finished: int = 0  # sequences finished
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    tpot_sum_s: float = 0.0  # each request's mean time per output token, summed
    tpot_count: int = 0


class CpuChoice(_Part):
    """The CPU an engine runs on and the kernel path it chose there (dpserve_engine.cpu_paths), for /status."""

    kind: str = ""  # avx2 | avx512 | avx512_bf16 | amx | baseline ("" off CPU)
    model: str = ""  # /proc/cpuinfo's model name
    kernel_path: str = ""  # int4 | q4 | q4q8 ("": not a quantized model on CPU, e.g. the null engine)
    reason: str = ""  # why that path; a path that gives up exactness also says so here


class EngineInfo(_Part):
    rank: int
    engine_id: str
    input_addr: str  # the engine ROUTER that frontends connect to
    state: EngineState = EngineState.STARTING
    node_ip: str = ""
    pid: int = 0
    kv_blocks_total: int = 0
    dead_reason: str = ""  # DEAD: why (the exit code, the signal, "did not register")
    restarts: int = 0  # replacements started for this rank so far
    failed: bool = False  # in a crash loop: it died soon after each of its last starts (retried on a back-off)
    deaths: dict[str, int] = {}  # times it went DEAD, by kind (killed, exited, missed_heartbeats, stuck, ...)
    block_size: int = 0  # tokens per KV block (prefix-cache hashes are per block; 0: an engine before #17)
    cpu: CpuChoice | None = None  # its CPU kind and kernel path (None: an engine before #35)


# ----------------------------------------------------------------------------------------------------------------
# To engines
# ----------------------------------------------------------------------------------------------------------------


class EngineRequest(_Msg, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0  # time.time() at the frontend
    frontend_id: str = ""
    wave: int = 0  # the wave the frontend believed current
    # A migrated request's continuation: the last `num_generated` prompt tokens are output tokens an earlier rank
    # produced; the sampling settings are the remaining ones, and seeded draws continue at this output position.
    num_generated: int = 0
    # The prompt tokens the routing API server counted for this sequence (what its rank's prefix cache did not
    # hold, as the API server saw it; -1: the whole prompt). The engine reports the same figure as received, so
    # the coordinator's reservation of that work ends exactly (coordinator reservations.py).
    routed_tokens: int = -1


class AbortRequests(_Msg, tag="abort"):
    request_ids: list[str]


class CoreUse(_Msg, tag="core_use"):
    """Engine rank -> the other ranks on its node (their ROUTER): it has work now (`busy`) or none. Sent when that
    changes, before the step's outputs go out, so that a neighbour picking up the next request already knows how
    many of the node's cores are free (engine threads.py); the coordinator's LoadSnapshot says it later."""

    rank: int
    busy: bool


class StartWave(_Msg, tag="start_wave"):
    """Coordinator -> engines: start stepping in wave `wave` (ignored by `exclude_rank` and if stale)."""

    wave: int
    exclude_rank: int | None = None


class Shutdown(_Msg, tag="shutdown"):
    """Coordinator -> engine: finish (drain) or stop now.

    Broadcast on PUB when the coordinator stops; sent to one engine on the control socket when a scale-down
    removes its rank. `drain_timeout_s` > 0 replaces the engine's own --drain-timeout-s for this drain."""

    drain: bool = True
    reason: str = ""
    drain_timeout_s: float = 0.0


# ----------------------------------------------------------------------------------------------------------------
# To frontends
# ----------------------------------------------------------------------------------------------------------------


class RequestOutput(_Part):
    """New tokens for one request from one engine step."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set on the first output)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # set once; the first prompt token has None
    error: str | None = None  # message when finish_reason is ERROR
    num_prompt_tokens: int = 0  # set on the first output
    queue_time_s: float | None = None  # set on the first output: engine arrival -> first scheduled (s)
    # An ERROR the client may retry later (or elsewhere), answered 503 + Retry-After: "queue_time" (it waited longer
    # than --max-queue-time-s in the rank's queue); the frontend itself uses "shutting_down" (its drain ran out).
    retry_reason: str | None = None


class EngineOutputs(_Msg, tag="outputs"):
    """Everything one engine step produced for one frontend."""

    engine_rank: int
    outputs: list[RequestOutput] = []
    load: EngineLoad | None = None
    timestamp: float = 0.0


class EngineHello(_Msg, tag="engine_hello"):
    """Engine -> frontend, the first message on a new connection, so the ROUTER learns the identity."""

    engine_rank: int


# ----------------------------------------------------------------------------------------------------------------
# To the coordinator (control ROUTER; DEALER identity = sender id)
# ----------------------------------------------------------------------------------------------------------------


class RegisterEngine(_Msg, tag="register_engine"):
    protocol_version: int
    rank: int  # -1: let the coordinator assign one (engines started by hand)
    engine_id: str
    input_addr: str
    model: ModelInfo
    kv_blocks_total: int = 0
    node_ip: str = ""
    pid: int = 0
    block_size: int = 0  # tokens per KV block: what its prefix cache hashes (dpserve_shared.block_hash)
    num_experts: int = 0  # an MoE model's experts (0: dense, or any): an expert-parallel size must divide it
    cpu: CpuChoice | None = None  # the CPU kind it detected and the kernel path it chose (cpu_paths.py)


class RegisterFrontend(_Msg, tag="register_frontend"):
    protocol_version: int
    frontend_id: str
    pid: int = 0
    http_addr: str = ""


class Unregister(_Msg, tag="unregister"):
    sender_id: str
    reason: str = ""


class Heartbeat(_Msg, tag="heartbeat"):
    sender_id: str
    timestamp: float = 0.0
    stats: FrontendStats | None = None  # a frontend's figures (engines send none)


class RankCount(_Part):
    """Requests (and their prompt tokens) one API server sent to one rank's engine, cumulative since it started
    sending to that engine (a rank's next engine starts from 0)."""

    rank: int
    engine_id: str
    num_requests: int = 0
    num_tokens: int = 0


class FrontendCount(_Part):
    """Requests (and their prompt tokens) one engine received from one API server, cumulative since it started."""

    frontend_id: str
    num_requests: int = 0
    num_tokens: int = 0


class EngineStats(_Msg, tag="engine_stats"):
    load: EngineLoad
    received: list[FrontendCount] = []  # per API server: what reached this engine (reservations end there)


class WaveComplete(_Msg, tag="wave_complete"):
    """Rank 0 of a lock-step (expert-parallel) deployment -> coordinator: the ranks' all-reduce found no rank with
    unfinished requests, so every rank paused at the same step and moved to wave `wave` + 1."""

    wave: int


class StartWaveRequest(_Msg, tag="start_wave_request"):
    """Frontend (first request while paused) or engine (request with a stale wave) -> coordinator."""

    wave: int
    rank: int  # the rank that already has the request (excluded from the broadcast unless stale)


MAX_DATA_PARALLEL_SIZE = 1024  # the largest target a ScaleRequest may ask for


class ScaleRequest(_Msg, tag="scale"):
    """Admin (`dpserve scale`) -> coordinator: make the deployment ranks 0..data_parallel_size-1.

    `drain_timeout_s`: how long a removed rank may take to finish its in-flight requests (0: the coordinator's
    default) before the rest are aborted."""

    data_parallel_size: int
    drain_timeout_s: float = 0.0


# ----------------------------------------------------------------------------------------------------------------
# From the coordinator (control replies and PUB broadcasts)
# ----------------------------------------------------------------------------------------------------------------


class Topology(_Msg, tag="topology"):
    epoch: int  # grows with every change
    engines: list[EngineInfo] = []
    model: ModelInfo | None = None
    data_parallel_size: int = 0  # target size


class LoadSnapshot(_Msg, tag="load"):
    loads: list[EngineLoad] = []
    wave: int = 0
    engines_running: bool = False
    timestamp: float = 0.0
    frontends: list[FrontendStats] = []  # every registered API server's newest figures


class RegisterAck(_Msg, tag="register_ack"):
    accepted: bool
    error: str | None = None
    rank: int = -1  # the rank assigned to an engine
    pub_addr: str = ""  # the coordinator's broadcast socket
    topology: Topology | None = None


class ScaleAck(_Msg, tag="scale_ack"):
    """Coordinator -> the ScaleRequest's sender, twice: when the step is accepted or refused (is_complete False
    unless refused or nothing to do), and when it has finished (is_complete True; accepted False if it failed,
    with the error). `pub_addr` lets the sender follow the step's Topology broadcasts; `topology` is the
    registry's view when the message was sent."""

    accepted: bool
    error: str | None = None
    data_parallel_size: int = 0
    is_complete: bool = False
    pub_addr: str = ""
    topology: Topology | None = None


class ExpertGroup(_Msg, tag="expert_group"):
    """Coordinator -> each engine (control) of an --enable-expert-parallel deployment, once every rank has
    registered: form the torch.distributed group at rank 0's node `host` and `port` (picked by the coordinator),
    as `rank` of `world_size`, giving up after `timeout_s` (also each collective's timeout).

    Re-forming (elastic EP: a scale step, a dead rank's replacement; docs/architecture.md "Re-forming the
    expert-parallel group"): a later `generation` replaces the rank's group. `leave_now` False: the members leave
    the old group together at the step where their all-reduce first sees the new generation; True (the old group
    is broken: a member died): at once. `rank` -1: leave and join no group (a rank a scale-down removes). After
    joining, every member steps in wave `wave` from its first step on."""

    host: str
    port: int
    world_size: int
    rank: int
    timeout_s: float = 120.0
    generation: int = 0
    leave_now: bool = False
    wave: int = 0


class ExpertGroupJoined(_Msg, tag="expert_group_joined"):
    """Engine -> coordinator: this rank is now in the expert-parallel group of `generation` (or, `is_member`
    False, left the previous one and joined none, as its ExpertGroup asked)."""

    generation: int
    is_member: bool = True


class ExpertGroupBroken(_Msg, tag="expert_group_broken"):
    """Engine -> coordinator: a step's collective failed in the group of `generation` (a peer died, or the model
    raised); the rank left the group, keeps its requests and waits for the next ExpertGroup."""

    generation: int
    reason: str = ""


class FrontendGone(_Msg, tag="frontend_gone"):
    """Coordinator -> engines: abort every request of this frontend."""

    frontend_id: str


# ----------------------------------------------------------------------------------------------------------------
# The shared view of the prefix caches (docs/architecture.md, "The prefix-cache index")
# ----------------------------------------------------------------------------------------------------------------


class KvEvents(_Msg, tag="kv_events"):
    """Engine -> coordinator (control): the block hashes its prefix cache stored and evicted since its last
    KvEvents (net: a hash is in at most one list), batched per step. `seq` counts this engine process's KvEvents
    from 1; a snapshot (the answer to KvResync) lists every hash it holds in `stored` and replaces the rank's set."""

    seq: int
    stored: list[int] = []
    removed: list[int] = []
    is_snapshot: bool = False


class KvResync(_Msg, tag="kv_resync"):
    """Coordinator -> one engine (control): send a snapshot of your prefix cache (a gap in your KvEvents)."""


class RankBlocks(_Part):
    """One rank's change in a KvDelta (with `reset`: its set was emptied first), or its whole set in a
    KvIndexSnapshot."""

    rank: int
    stored: list[int] = []
    removed: list[int] = []
    reset: bool = False


class KvDelta(_Msg, tag="kv_delta"):
    """Coordinator -> frontends (PUB): the index's changes since the previous KvDelta. `seq` counts them from 1
    per `index_id` (the coordinator's start time in ms): a frontend that sees a gap or a new index_id asks for a
    KvIndexSnapshot."""

    index_id: int
    seq: int
    ranks: list[RankBlocks] = []


class RoutedRequests(_Msg, tag="routed"):
    """Frontend -> coordinator (control), when it changed (at most every 20 ms): what this API server has routed
    to each rank so far. The coordinator reserves what the engines have not reported receiving (EngineStats
    .received) on the next LoadSnapshot, so API servers routing a burst at once see each other's picks."""

    frontend_id: str
    sent: list[RankCount] = []


class KvIndexRequest(_Msg, tag="kv_index_request"):
    """Frontend -> coordinator (control): send me the whole index (just started, a gap, a new coordinator)."""

    frontend_id: str


class KvIndexSnapshot(_Msg, tag="kv_index"):
    """Coordinator -> one frontend (control): the whole index as of KvDelta `seq` (deltas after it follow)."""

    index_id: int
    seq: int
    ranks: list[RankBlocks] = []


ToEngine = EngineRequest | AbortRequests | CoreUse
ToFrontend = EngineOutputs | EngineHello
ToCoordinator = (
    RegisterEngine
    | RegisterFrontend
    | Unregister
    | Heartbeat
    | EngineStats
    | StartWaveRequest
    | WaveComplete
    | ScaleRequest
    | KvEvents
    | KvIndexRequest
    | RoutedRequests
    | ExpertGroupJoined
    | ExpertGroupBroken
)
FromCoordinator = (
    Topology
    | LoadSnapshot
    | RegisterAck
    | ScaleAck
    | StartWave
    | Shutdown
    | FrontendGone
    | KvResync
    | KvDelta
    | KvIndexSnapshot
    | ExpertGroup
)
