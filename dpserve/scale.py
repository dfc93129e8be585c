"""`dpserve scale --data-parallel-size K`: add or remove engine ranks of a running deployment (elastic DP).

A DEALER to the coordinator's control socket sends `ScaleRequest(K)`. The coordinator answers at once (refused,
with the reason, or accepted with its broadcast address), then once more when the step is done. In between this
command follows the coordinator's Topology broadcasts and prints each change (ranks ready / starting / draining /
gone). Exit code 0 when the deployment has exactly the ranks 0..K-1 READY, 1 when the coordinator refused or the
step failed or did not finish within --timeout-s (the step itself goes on), 2 on a usage error. It needs the
deployment's cluster key: $DPSERVE_CLUSTER_KEY or --cluster-key-file, or, for a `dpserve serve` on this host that
made its own, the file it keeps for its own user (zmq_security.run_key_path); --insecure-zmq for a deployment
without.
"""

from __future__ import annotations

import argparse
import time
import uuid

import zmq

from dpserve_shared.codec import from_coordinator_decoder
from dpserve_shared.envelope import frames, split
from dpserve_shared.schema import EngineState, ScaleAck, ScaleRequest, Topology
from dpserve_shared.zmq_security import ClusterKeyError, add_security_flags, run_key_path, security_from_args

_ANSWER_TIMEOUT_S = 10.0


def add_scale_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-parallel-size", "-dp", type=int, required=True, help="the new number of ranks")
    parser.add_argument("--coordinator", default=None, help="the coordinator's control address, tcp://HOST:PORT")
    parser.add_argument("--data-parallel-address", default="127.0.0.1", help="the coordinator's address (as serve)")
    parser.add_argument("--data-parallel-rpc-port", type=int, default=29550, help="its control port (as serve)")
    parser.add_argument(
        "--drain-timeout", type=float, default=0.0,
        help="seconds a removed rank may take to finish its requests before the rest are aborted "
             "(default: the coordinator's, 120)",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up waiting after this long")
    add_security_flags(parser)


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} dpserve scale: {message}", flush=True)


def describe(topology: Topology) -> str:
    by_state: dict[str, list[int]] = {}
    for engine in topology.engines:
        by_state.setdefault(engine.state.value, []).append(engine.rank)
    parts = [f"{state} {ranks}" for state, ranks in sorted(by_state.items())]
    return f"target {topology.data_parallel_size}: " + (", ".join(parts) or "no ranks")


def is_scaled(topology: Topology, size: int) -> bool:
    """Exactly ranks 0..size-1, all READY."""
    return sorted((e.rank, e.state) for e in topology.engines) == [(r, EngineState.READY) for r in range(size)]


def scale(args: argparse.Namespace) -> int:
    addr = args.coordinator or f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}"
    size = args.data_parallel_size
    started = time.monotonic()
    deadline = started + args.timeout_s
    try:
        zmq_security = security_from_args(args, "dpserve scale", run_key_file=run_key_path(addr))
    except ClusterKeyError as e:
        _say(str(e))
        return 2
    decoder = from_coordinator_decoder()
    ctx = zmq.Context()
    control = ctx.socket(zmq.DEALER)
    zmq_security.client(control)
    control.setsockopt(zmq.IDENTITY, f"scale-{uuid.uuid4().hex[:12]}".encode())
    control.setsockopt(zmq.LINGER, 0)
    sub = ctx.socket(zmq.SUB)
    zmq_security.client(sub)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        control.connect(addr)
        control.send_multipart(frames("", ScaleRequest(size, drain_timeout_s=args.drain_timeout)))
        if not control.poll(int(_ANSWER_TIMEOUT_S * 1000)):
            _say(f"no answer from the coordinator at {addr} within {_ANSWER_TIMEOUT_S:.0f} s (is it running? "
                 "give its address with --coordinator or --data-parallel-address/--data-parallel-rpc-port; "
                 "is $DPSERVE_CLUSTER_KEY the key it was started with?)")
            return 1
        envelope = split(control.recv_multipart())
        if envelope is None:
            _say(f"the peer at {addr} is not a dpserve coordinator of this release")
            return 1
        deployment_id, data = envelope  # the broadcasts of this deployment only
        ack = decoder.decode(data)
        if not isinstance(ack, ScaleAck):
            _say(f"unexpected answer {type(ack).__name__} from {addr}")
            return 1
        if not ack.accepted:
            _say(f"refused: {ack.error}")
            return 1
        _say(f"accepted: scaling to {size} ranks" + (f" ({describe(ack.topology)})" if ack.topology else ""))
        if ack.pub_addr:
            sub.connect(ack.pub_addr)
        last = describe(ack.topology) if ack.topology else ""
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        while not ack.is_complete:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                _say(f"timed out after {args.timeout_s:.0f} s (the coordinator goes on with the step); now: {last}")
                return 1
            for sock, _ in poller.poll(min(remaining_ms, 1000)):
                envelope = split(sock.recv_multipart())
                if envelope is None or envelope[0] != deployment_id:
                    continue
                msg = decoder.decode(envelope[1])
                if isinstance(msg, Topology):
                    now = describe(msg)
                    if now != last:
                        _say(now)
                        last = now
                elif isinstance(msg, ScaleAck):
                    ack = msg
        if not ack.accepted:
            _say(f"failed: {ack.error}")
            return 1
        if ack.topology is not None and not is_scaled(ack.topology, size):
            _say(f"done, but the ranks are not 0..{size - 1} READY: {describe(ack.topology)}")
            return 1
        _say(f"done in {time.monotonic() - started:.1f} s: {size} ranks ready")
        return 0
    finally:
        control.close(0)
        sub.close(0)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("dpserve scale", description=__doc__)
    add_scale_flags(parser)
    return scale(parser.parse_args(argv))
