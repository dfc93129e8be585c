"""Authenticated ZMQ: every socket of a deployment speaks CurveZMQ with one deployment secret, the cluster key.

The cluster key is a string of at least 32 characters (`openssl rand -hex 32`; `dpserve serve` makes one per run
unless given one). Every process derives the same Curve keypair from it (SHA-256 of the key = the secret key), so:

- every server socket (the coordinator's control ROUTER and broadcast PUB, each engine's ROUTER) is a CURVE server
  with that keypair, and a ZAP handler in its context admits only clients that present that same public key;
- every client socket (DEALERs, SUBs) is a CURVE client with that keypair as its own and its public key as the
  server's key.

A handshake thus succeeds only between two holders of the key: the server proves it to the client (the client
encrypts to the server's public key), and the client proves it to the server (CurveZMQ's INITIATE vouches for the
client's public key with its secret key, and ZAP checks that public key). A peer without the key, or with another
deployment's, gets no message through either way; the server logs the refused handshake once per peer address,
at most a few lines a minute (`RefusalLog`). Messages are encrypted too.

Where the key comes from (`security_from_args`, the one reader): `--insecure-zmq` (no CURVE, with a warning),
else `--cluster-key-file PATH` (a file only its owner may read), else `$DPSERVE_CLUSTER_KEY`. A process started
without any of the three refuses to start, naming them. Children get the key in their environment
(`ZmqSecurity.child_env`), never on a command line (`ps` shows those to every user), and no log line shows it:
`ZmqSecurity`'s repr hides it and the start-up line names only a fingerprint of the public key.

The data classes' default (`from_environment`: the key of $DPSERVE_CLUSTER_KEY, else insecure) serves in-process
users (tests); the command lines never rely on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

CLUSTER_KEY_ENV = "DPSERVE_CLUSTER_KEY"
MIN_KEY_CHARS = 32
_KEY_DERIVATION = b"dpserve cluster key v1\0"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)

log = logging.getLogger("dpserve.zmq_security")


class ClusterKeyError(ValueError):
    """No usable cluster key; the message names the ways to give one."""


def new_cluster_key() -> str:
    """A fresh cluster key: 32 random bytes as hex (the same as `openssl rand -hex 32`)."""
    return os.urandom(32).hex()


@dataclasses.dataclass(frozen=True)
class ZmqSecurity:
    """The deployment's Curve keys (z85), or none (`--insecure-zmq`). Never in a repr: nothing logs the key."""

    cluster_key: str = dataclasses.field(default="", repr=False)
    public_key: bytes = dataclasses.field(default=b"", repr=False)
    secret_key: bytes = dataclasses.field(default=b"", repr=False)

    @classmethod
    def insecure(cls) -> ZmqSecurity:
        return cls()

    @classmethod
    def from_cluster_key(cls, cluster_key: str, source: str = f"${CLUSTER_KEY_ENV}") -> ZmqSecurity:
        key = cluster_key.strip()
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise ClusterKeyError(
                f"the cluster key in {source} must be at least {MIN_KEY_CHARS} characters without spaces "
                "(make one with `openssl rand -hex 32`)"
            )
        secret = z85.encode(hashlib.sha256(_KEY_DERIVATION + key.encode()).digest())
        return cls(key, zmq.curve_public(secret), secret)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ZmqSecurity:
        """The default of the services' settings data classes: $DPSERVE_CLUSTER_KEY's key, else insecure."""
        key = environ.get(CLUSTER_KEY_ENV, "")
        return cls.from_cluster_key(key) if key else cls.insecure()

    @property
    def is_secure(self) -> bool:
        return bool(self.secret_key)

    @property
    def fingerprint(self) -> str:
        """A short hash of the public key: tells two processes' keys apart in logs without showing either."""
        return hashlib.sha256(self.public_key).hexdigest()[:8] if self.is_secure else "none"

    def describe(self) -> str:
        """The start-up log line's words for it."""
        if not self.is_secure:
            return "ZMQ sockets are NOT authenticated (--insecure-zmq)"
        return f"ZMQ sockets use CURVE with the cluster key (fingerprint {self.fingerprint})"

    # -- what children get --------------------------------------------------------------------------------------

    def child_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """`env` for a child process of this deployment: the key in it when secure, no key at all when not."""
        child = {k: v for k, v in env.items() if k != CLUSTER_KEY_ENV}
        if self.is_secure:
            child[CLUSTER_KEY_ENV] = self.cluster_key
        return child

    def child_argv(self) -> list[str]:
        """The flags a child of this deployment needs on its command line (never the key)."""
        return [] if self.is_secure else ["--insecure-zmq"]

    # -- sockets ------------------------------------------------------------------------------------------------

    def server(self, sock: zmq.Socket, what: str) -> None:
        """Make `sock` (before it binds) a CURVE server that admits holders of the key only; refused handshakes
        are logged as refusals on `what` ("control socket"). A no-op when insecure."""
        if not self.is_secure:
            return
        _ensure_zap_handler(sock.context)
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.zap_domain = self.public_key  # the ZAP handler admits the clients presenting the domain's key
        sock.curve_server = True
        _watch_refusals(sock, what)

    def client(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it connects) a CURVE client of this deployment's servers. A no-op when insecure."""
        if not self.is_secure:
            return
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_serverkey = self.public_key


# -- the command line ---------------------------------------------------------------------------------------------


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster-key-file", default=None, metavar="PATH",
        help=f"a file holding the deployment's cluster key (readable by its owner only: chmod 600), which every "
             f"ZMQ peer of the deployment must hold (default: ${CLUSTER_KEY_ENV})",
    )  # fmt: skip
    parser.add_argument(
        "--insecure-zmq", action="store_true",
        help="no CURVE on the ZMQ sockets: anyone who reaches the ports can register, scale or stop ranks "
             "(for trusted networks and measurements only)",
    )  # fmt: skip


def _missing_key_message(what: str) -> str:
    return (
        f"{what} needs the deployment's cluster key: set ${CLUSTER_KEY_ENV}, or give --cluster-key-file PATH "
        f"(the same key as the rest of the deployment; make one with `openssl rand -hex 32`), or pass "
        "--insecure-zmq to run without authentication"
    )


def read_key_file(path: str) -> str:
    """The key in `path`; ClusterKeyError if it is missing, or readable by anyone but its owner."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read()
    except OSError as e:
        raise ClusterKeyError(f"--cluster-key-file {path}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterKeyError(
            f"--cluster-key-file {path} is accessible to other users (mode {stat.filemode(mode)}): "
            f"`chmod 600 {path}`"
        )
    return text


def run_key_path(control_addr: str) -> str:
    """Where `dpserve serve` keeps the key it made for the deployment whose control socket is `control_addr`
    (tcp://HOST:PORT), for `dpserve scale` on the same host to find: a file of the user's own (mode 600, in a
    directory of mode 700) under $XDG_RUNTIME_DIR or ~/.cache/dpserve, removed when the deployment stops."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
    name = control_addr.removeprefix("tcp://").replace(":", "-").replace("/", "-")
    return os.path.join(base, "dpserve", "run", f"cluster-key-{name}")


def write_run_key(path: str, cluster_key: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of that name may have had another mode
        f.write(cluster_key)


def remove_run_key(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def security_from_args(
    args: argparse.Namespace, what: str, environ: Mapping[str, str] = os.environ, make_one: bool = False,
    run_key_file: str | None = None,
) -> ZmqSecurity:
    """The one reader of the key: --insecure-zmq, else --cluster-key-file, else $DPSERVE_CLUSTER_KEY, else
    (`dpserve scale`) the key a `dpserve serve` on this host made for the deployment (`run_key_path`), else a new
    key when `make_one` (`dpserve serve`), else ClusterKeyError naming all three."""
    if args.insecure_zmq:
        if args.cluster_key_file:
            raise ClusterKeyError("--insecure-zmq and --cluster-key-file contradict each other: give one")
        return ZmqSecurity.insecure()
    if args.cluster_key_file:
        return ZmqSecurity.from_cluster_key(read_key_file(args.cluster_key_file), f"--cluster-key-file "
                                            f"{args.cluster_key_file}")  # fmt: skip
    if environ.get(CLUSTER_KEY_ENV):
        return ZmqSecurity.from_cluster_key(environ[CLUSTER_KEY_ENV])
    if run_key_file and os.path.exists(run_key_file):
        return ZmqSecurity.from_cluster_key(read_key_file(run_key_file), f"{run_key_file} (made by dpserve serve)")
    if make_one:
        return ZmqSecurity.from_cluster_key(new_cluster_key())
    raise ClusterKeyError(_missing_key_message(what))


def log_security(logger: logging.Logger, security: ZmqSecurity) -> None:
    """The start-up line: a warning when insecure."""
    if security.is_secure:
        logger.info("%s", security.describe())
    else:
        logger.warning("%s: anyone who reaches the ports can register, scale or stop ranks", security.describe())


# -- the ZAP handler ----------------------------------------------------------------------------------------------


def _ensure_zap_handler(context: zmq.Context) -> None:
    """Start this context's ZAP handler unless one is bound already (one per context: libzmq asks the handler at a
    fixed inproc address). Bound here, before any server socket binds, so no handshake ever goes unchecked."""
    sync_context = zmq.Context.shadow(context.underlying)
    handler = sync_context.socket(zmq.REP)
    handler.linger = 0
    try:
        handler.bind(_ZAP_ENDPOINT)
    except zmq.ZMQError as e:
        handler.close(0)
        if e.errno == zmq.EADDRINUSE:
            return  # this context's handler runs already
        raise
    threading.Thread(target=_serve_zap, args=(handler,), name="zmq-zap", daemon=True).start()


def zap_reply(request: list[bytes]) -> list[bytes]:
    """RFC 27: admit a CURVE client whose public key is the one named by the server socket's ZAP domain."""
    version, request_id, domain, _address, _identity, mechanism, *credentials = request
    admitted = mechanism == b"CURVE" and len(credentials) == 1 and z85.encode(credentials[0]) == domain
    status = (b"200", b"OK") if admitted else (b"400", b"not this deployment's cluster key")
    return [version, request_id, *status, b"", b""]


def _serve_zap(handler: zmq.Socket) -> None:
    """Answer ZAP requests until the context terminates (every blocking call then raises ETERM)."""
    try:
        while True:
            request = handler.recv_multipart()
            try:
                reply = zap_reply(request)
            except ValueError:  # a malformed request: refuse it
                reply = [*request[:2], b"400", b"malformed ZAP request", b"", b""]
            handler.send_multipart(reply)
    except zmq.ZMQError:
        pass  # the context is terminating
    finally:
        handler.close(0)


# -- refused handshakes, logged -----------------------------------------------------------------------------------

_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
}
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
for _event in _HANDSHAKE_FAILED:
    _WATCHED |= _event


def refusal_reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "its key is not this deployment's cluster key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "it does not speak CURVE (no cluster key, or --insecure-zmq on that side)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "it holds another cluster key"
    return "the CURVE handshake failed"


class RefusalLog:
    """Refused handshakes, logged once per peer address and at most `max_lines` lines per `window_s` (a scan or
    a misconfigured peer reconnecting every 100 ms must not flood the log); what is not logged is counted."""

    MAX_PEERS = 4096  # remembered addresses; beyond that, new ones are counted, not logged

    def __init__(self, logger: logging.Logger = log, max_lines: int = 10, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self._log = logger
        self._max_lines = max_lines
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._window_start = -float("inf")
        self._lines_in_window = 0
        self.num_refused = 0
        self.num_unlogged = 0

    def refused(self, what: str, peer: str, reason: str) -> bool:
        """Count one refusal; True if it was logged."""
        with self._lock:
            self.num_refused += 1
            now = self._clock()
            if now - self._window_start >= self._window_s:
                self._window_start, self._lines_in_window = now, 0
            if peer in self._seen or len(self._seen) >= self.MAX_PEERS or self._lines_in_window >= self._max_lines:
                self.num_unlogged += 1
                return False
            self._seen.add(peer)
            self._lines_in_window += 1
            unlogged = f" ({self.num_unlogged} earlier refusals not logged)" if self.num_unlogged else ""
            self._log.warning("refused a ZMQ connection to the %s from %s: %s; further refusals of this peer are "
                              "not logged%s", what, peer, reason, unlogged)
            return True


REFUSALS = RefusalLog()  # the process's: one rate limit for all its server sockets


def _peer_of(fd: int) -> str:
    """The address of the TCP peer on `fd` (a connection libzmq just accepted), or "an unknown peer" when it is
    gone already (a peer without CURVE is refused within a round trip, maybe before this thread runs)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return "an unknown peer"
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return "an unknown peer"
    finally:
        sock.detach()  # libzmq's descriptor: never closed here


def _watch_refusals(sock: zmq.Socket, what: str) -> None:
    """A thread that reads `sock`'s monitor events and logs each refused handshake (REFUSALS). The peer is known
    from the accepted connection's descriptor: with the context's one I/O thread, a failed handshake's event comes
    right before its connection's DISCONNECTED event, which names the descriptor."""
    endpoint = f"inproc://dpserve-monitor-{id(sock):x}"
    sock.monitor(endpoint, _WATCHED)
    events = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
    events.linger = 0
    events.connect(endpoint)
    threading.Thread(target=_log_refusals, args=(events, what), name="zmq-monitor", daemon=True).start()


def _log_refusals(events: zmq.Socket, what: str) -> None:
    peers: dict[int, str] = {}
    failed: tuple[int, int] | None = None
    try:
        while True:
            message = parse_monitor_message(events.recv_multipart())
            event, value = message["event"], message["value"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event == zmq.EVENT_ACCEPTED:
                peers[value] = _peer_of(value)
            elif event in _HANDSHAKE_FAILED:
                failed = (event, value)
            elif event == zmq.EVENT_DISCONNECTED:
                peer = peers.pop(value, "an unknown peer")
                if failed is not None:
                    REFUSALS.refused(what, peer, refusal_reason(*failed))
                    failed = None
    except zmq.ZMQError:
        pass  # the context is terminating
    finally:
        events.close(0)
