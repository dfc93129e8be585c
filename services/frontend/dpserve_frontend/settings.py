"""The frontend's settings: one frozen dataclass, built from the command line (and DPSERVE_* variables)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import uuid

from dpserve_shared.envelope import DEPLOYMENT_ID_ENV, deployment_id_from_env
from dpserve_shared.status import API_KEY_ENV
from dpserve_shared.timing import COORDINATOR_SILENCE_S, HEARTBEAT_INTERVAL_S
from dpserve_shared.zmq_security import ClusterKeyError, ZmqSecurity, add_security_flags, security_from_args

from dpserve_frontend.router import RoutingPolicy

ENV_PREFIX = "DPSERVE_"


@dataclasses.dataclass(frozen=True)
class FrontendSettings:
    coordinator_addr: str | None = None  # tcp://HOST:PORT of the coordinator's control socket; None: no coordinator
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = dataclasses.field(default=None, repr=False)  # never logged
    frontend_id: str = dataclasses.field(default_factory=lambda: f"fe-{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    log_level: str = "info"
    # SIGTERM: how long in-flight requests may still run (/health 503, new requests 503) before they are ended
    shutdown_timeout_s: float = 30.0
    register_timeout_s: float = 0.0  # 0 = keep retrying until the coordinator answers
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    stats_interval_s: float = 10.0  # the periodic per-rank stats log line
    coordinator_silence_s: float = COORDINATOR_SILENCE_S  # no broadcast this long: register again
    deployment_id: str = ""  # "": adopt the id of the coordinator that accepts this frontend (envelope.py)
    strict_request_fields: bool = False  # unknown request fields: a 400 (OpenAI) instead of ignored (vLLM)
    migration_limit: int = 3  # moves of one request to another rank after its rank died (engine_pool.py)
    ready_file: str | None = None  # written once this frontend follows the broadcasts and sees every rank serve
    chat_template: str | None = None  # --chat-template: replaces the model's own (the template's text)
    # Structured outputs (structured.py): the limits on checking a request's grammar, and JSON's default spacing
    structured_output_compile_timeout_s: float = 5.0
    structured_output_max_bytes: int = 64 * 1024
    is_json_whitespace_flexible: bool = False  # --structured-output-whitespace flexible
    # Admission control (router.py): per rank, what may wait in its queue; None = no cap
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    # Hostile or broken clients (add_http_limit_flags says why these defaults).
    max_request_body_bytes: int = 8 * 1024 * 1024
    request_header_timeout_s: float = 60.0
    request_body_timeout_s: float = 60.0
    # CURVE on its sockets to the coordinator and the engines, as clients (zmq_security.py)
    zmq_security: ZmqSecurity = dataclasses.field(default_factory=ZmqSecurity.from_environment, repr=False)
    routing: RoutingPolicy = RoutingPolicy.CACHE_AWARE  # --routing (router.py)


def add_migration_flag(parser: argparse.ArgumentParser) -> None:
    """--migration-limit, for the frontend and for `dpserve serve` (which passes it on)."""
    parser.add_argument("--migration-limit", type=_non_negative_int, default=FrontendSettings.migration_limit,
                        help="how many times a request moves to another rank when its rank dies: a started stream "
                             "goes on as its continuation (prompt + the tokens so far), with no gap or repeat; 0: a "
                             "started stream ends with an error event instead (default: %(default)s)")


def add_routing_flag(parser: argparse.ArgumentParser) -> None:
    """--routing, for the frontend and for `dpserve serve` (which passes it on)."""
    parser.add_argument("--routing", choices=[p.value for p in RoutingPolicy],
                        default=RoutingPolicy.CACHE_AWARE.value,
                        help="how a request's rank is chosen: cache-aware (the lowest estimated time to first token: "
                             "the prompt tokens not in the rank's prefix cache plus its queued prefill, over the "
                             "measured prefill rate, plus decode, batch-slot and KV pressure; a rank well above the "
                             "mean load is skipped; every API server sees the same cache view), least-loaded (fewest "
                             "waiting and running requests, vLLM's rule), or round-robin (default: %(default)s; "
                             "docs/benchmarks.md compares them)")


def add_admission_flags(parser: argparse.ArgumentParser) -> None:
    """--max-num-queued-requests/-tokens, for the frontend and for `dpserve serve` (which passes them on)."""
    parser.add_argument("--max-num-queued-requests", "--max-num-queued-reqs", type=_positive_int, default=None,
                        metavar="N", dest="max_num_queued_requests",
                        help="per rank: a new request goes only to a rank with fewer than N requests waiting (as "
                             "this API server sees it: the coordinator's load plus its own sends); when every rank "
                             "it could go to is full it is answered 503 with Retry-After at once (default: no cap)")
    parser.add_argument("--max-num-queued-tokens", type=_positive_int, default=None, metavar="N",
                        help="the same for the prompt tokens waiting on a rank (default: no cap)")


def add_shutdown_timeout_flag(parser: argparse.ArgumentParser, *aliases: str) -> None:
    """--shutdown-timeout (vLLM's name), for the frontend (alias --drain-timeout, its old name) and `dpserve
    serve`."""
    parser.add_argument("--shutdown-timeout", *aliases, type=_non_negative_float, dest="shutdown_timeout",
                        default=FrontendSettings.shutdown_timeout_s, metavar="SECONDS",
                        help="on SIGTERM, /health answers 503 and new requests 503 at once, and requests in flight "
                             "may finish for this long; then they end with an error (default: %(default)s)")
def add_http_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The limits on what one HTTP client may cost an API server, for the frontend and for `dpserve serve`."""
    defaults = FrontendSettings
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=defaults.max_request_body_bytes,
                        metavar="BYTES",
                        help="larger request bodies get a 413; the default (8 MiB) holds a full context of token "
                             "ids many times over while bounding what each request can make the server buffer "
                             "(default: %(default)s)")
    parser.add_argument("--request-header-timeout", type=_positive_float, default=defaults.request_header_timeout_s,
                        metavar="SECONDS",
                        help="a connection that has not sent a whole request head this long after it opened (or "
                             "after its previous response) is closed: slow-header clients hold nothing for long, "
                             "and neither does an idle keep-alive connection (default: %(default)s)")
    parser.add_argument("--request-body-timeout", type=_positive_float, default=defaults.request_body_timeout_s,
                        metavar="SECONDS",
                        help="a request whose body has not fully arrived this long after its head gets a 408 and "
                             "its connection is closed (default: %(default)s)")


TOOL_CALL_PARSERS = ("hermes",)  # hermes.py
WHITESPACE_CHOICES = ("compact", "flexible")


def add_structured_output_flags(parser: argparse.ArgumentParser) -> None:
    """Tool calling's format and the structured-output limits, for the frontend and for `dpserve serve`."""
    defaults = FrontendSettings
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=TOOL_CALL_PARSERS[0],
                        help="the format tools are called in, as vLLM's flag; hermes (the only one): "
                             "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>, ChatML models' format. "
                             "A chat template that does not render tools gets them in its system prompt in that "
                             "format (default: %(default)s)")
    parser.add_argument("--structured-output-compile-timeout", type=_positive_float, metavar="SECONDS",
                        default=defaults.structured_output_compile_timeout_s,
                        help="a request's constraint (response_format, structured_outputs, guided_*, tools) is "
                             "compiled for the model's tokenizer before the request is routed; one that takes "
                             "longer is answered 400 (default: %(default)s)")
    parser.add_argument("--structured-output-max-bytes", type=_positive_int, metavar="BYTES",
                        default=defaults.structured_output_max_bytes,
                        help="a constraint whose grammar (the schema, regex, grammar or tools as llguidance "
                             "takes them) is larger is answered 400 (default: %(default)s)")
    parser.add_argument("--structured-output-whitespace", choices=WHITESPACE_CHOICES, default="compact",
                        help="whitespace between the tokens of constrained JSON: compact allows none (a small model "
                             "given the choice can pad its JSON with newlines until max_tokens), flexible allows "
                             "any; a request's structured_outputs.disable_any_whitespace overrides it (default: "
                             "%(default)s)")


def structured_output_argv(args: argparse.Namespace) -> list[str]:
    """The flags of add_structured_output_flags that differ from their defaults, for a frontend's command line."""
    defaults = FrontendSettings
    argv = []  # (--tool-call-parser has one value)
    if args.structured_output_compile_timeout != defaults.structured_output_compile_timeout_s:
        argv += ["--structured-output-compile-timeout", repr(args.structured_output_compile_timeout)]
    if args.structured_output_max_bytes != defaults.structured_output_max_bytes:
        argv += ["--structured-output-max-bytes", str(args.structured_output_max_bytes)]
    if args.structured_output_whitespace != "compact":
        argv += ["--structured-output-whitespace", args.structured_output_whitespace]
    return argv


def http_limit_argv(args: argparse.Namespace) -> list[str]:
    """The flags of add_http_limit_flags that differ from their defaults, for a frontend's command line."""
    defaults = FrontendSettings
    argv = []
    if args.max_request_body_bytes != defaults.max_request_body_bytes:
        argv += ["--max-request-body-bytes", str(args.max_request_body_bytes)]
    if args.request_header_timeout != defaults.request_header_timeout_s:
        argv += ["--request-header-timeout", repr(args.request_header_timeout)]
    if args.request_body_timeout != defaults.request_body_timeout_s:
        argv += ["--request-body-timeout", repr(args.request_body_timeout)]
    return argv


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def read_chat_template(value: str) -> str:
    """--chat-template's text: a file's contents, or the value itself when it is a template (vLLM accepts both);
    ValueError naming the flag for a missing file or a template that does not compile."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template: no such file: {value}")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpserve-frontend",
        description=(
            "dpserve's OpenAI-compatible HTTP frontend. Registers with the coordinator, receives the topology "
            "(engine addresses, tokenizer, chat template), connects to every engine rank and routes each request "
            "to the least-loaded one. Several frontends may share one port (SO_REUSEPORT)."
        ),
    )
    parser.add_argument("--coordinator", required=True, metavar="tcp://HOST:PORT",
                        help="the coordinator's control address (dpserve serve's --data-parallel-rpc-port)")
    parser.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port, shared with SO_REUSEPORT (default: 8000)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--frontend-id", default=None, help="this frontend's id (default: fe-<host>-<random>)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--stats-interval", type=float, default=10.0, metavar="SECONDS",
                        help="interval of the per-rank stats log line, 0 = off (default: 10)")
    parser.add_argument(
        "--deployment-id", default=deployment_id_from_env(),
        help=f"the deployment this frontend belongs to; coordinator messages of any other are ignored "
             f"(default: ${DEPLOYMENT_ID_ENV}, else that of the coordinator that accepts it)",
    )
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="answer unknown request fields with a 400, as OpenAI does (default: ignore them and "
                             "name them once in the log, as vLLM does)")
    add_migration_flag(parser)
    add_admission_flags(parser)
    add_routing_flag(parser)
    add_shutdown_timeout_flag(parser, "--drain-timeout")
    add_http_limit_flags(parser)
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file (or the template itself) replacing the model's own, as "
                             "vLLM's --chat-template (default: the model's)")
    add_structured_output_flags(parser)
    parser.add_argument("--ready-file", default=None, metavar="PATH",
                        help="written once this frontend follows the coordinator's broadcasts and every expected "
                             "rank serves (used by dpserve serve)")
    add_security_flags(parser)
    return parser


def settings_from_args(argv: list[str] | None = None) -> FrontendSettings:
    args = build_parser().parse_args(argv)
    if not args.coordinator.startswith(("tcp://", "ipc://", "inproc://")):
        raise SystemExit(f"--coordinator must be a ZMQ address like tcp://HOST:PORT, got {args.coordinator!r}")
    if not 0 < args.port < 65536:
        raise SystemExit(f"--port must be in 1..65535, got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        zmq_security = security_from_args(args, "dpserve-frontend")
    except ClusterKeyError as e:
        raise SystemExit(str(e)) from None
    kwargs = {}
    if args.frontend_id:
        kwargs["frontend_id"] = args.frontend_id
    return FrontendSettings(
        coordinator_addr=args.coordinator,
        host=args.host,
        port=args.port,
        api_key=api_key,
        log_level=args.log_level,
        shutdown_timeout_s=args.shutdown_timeout,
        max_num_queued_requests=args.max_num_queued_requests,
        max_num_queued_tokens=args.max_num_queued_tokens,
        routing=RoutingPolicy(args.routing),
        stats_interval_s=args.stats_interval,
        ready_file=args.ready_file,
        strict_request_fields=args.strict_request_fields,
        migration_limit=args.migration_limit,
        deployment_id=args.deployment_id,
        chat_template=chat_template,
        structured_output_compile_timeout_s=args.structured_output_compile_timeout,
        structured_output_max_bytes=args.structured_output_max_bytes,
        is_json_whitespace_flexible=args.structured_output_whitespace == "flexible",
        max_request_body_bytes=args.max_request_body_bytes,
        request_header_timeout_s=args.request_header_timeout,
        request_body_timeout_s=args.request_body_timeout,
        zmq_security=zmq_security,
        **kwargs,
    )
