"""`dpserve bench chaos`: what a rank's death costs the users of a deployment, measured through HTTP.

It starts a deployment (`dpserve serve`, DP=2 on ray by default; or targets one with --base-url and
--data-parallel-rpc-port), runs a closed-loop streaming load (--concurrency clients, each sending its next
greedy completion when the last one ends) for --duration-s without faults (the baseline), then the same load
again while one random serving rank is hit every --fault-interval-s:

  kill    SIGKILL to the rank's engine process (a crash, an OOM kill)
  stop    SIGSTOP to it (a hang: the coordinator finds it silent, kills and replaces it)
  actor   SIGKILL to the Ray worker that hosts the rank (its actor dies; ray backend only)
  coordinator  SIGKILL to the coordinator (`dpserve serve` restarts it; it re-attaches to the running engines):
          its timeline is that of the API servers' view (/status.json's coordinator.reachable), "rank" is -1

A request is ok (its stream ended with [DONE] and no error event), failed (an HTTP error, an error event, a
stream cut short), or hung (no byte for --hung-s, or no end by the phase's deadline + --hung-s). Each fault's
timeline is read from /health?rank=N: when the rank stopped serving and when it served again (recovery = from the
fault to serving again). Requests moved to another rank are counted by the API servers
(dpserve:request_migrations on /metrics). The last line says it all:

  chaos: sent=N ok=N migrated=N failed=N hung=N recovery_s_max=X goodput_ratio=Y

goodput_ratio = the faulted phase's ok output tokens per second / the baseline's. --output-json keeps every
figure, both phases and each fault's timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import orjson
from dpserve_shared.net import free_port

FAULTS = ("kill", "stop", "actor", "coordinator")


@dataclasses.dataclass
class Phase:
    name: str
    sent: int = 0
    ok: int = 0
    failed: int = 0
    hung: int = 0
    ok_tokens: int = 0
    duration_s: float = 0.0
    migrated: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)  # the first few, for the report

    @property
    def goodput(self) -> float:
        return self.ok_tokens / self.duration_s if self.duration_s else 0.0


@dataclasses.dataclass
class Fault:
    rank: int
    how: str
    pid: int
    at_s: float  # seconds since the faulted phase began
    down_after_s: float | None = None  # /health?rank=N stopped answering 200
    recovery_s: float | None = None  # ... and answered 200 again (a new engine process)


# -- the deployment -------------------------------------------------------------------------------------------------


def _get_json(url: str, timeout_s: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.load(e)
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def _find_process(*parts: str) -> int | None:
    """The first process on this host whose command line (NUL-separated) contains every one of `parts`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if all(part in cmdline for part in parts):
            return int(entry)
    return None


def engine_pid(rpc_port: int, rank: int) -> int | None:
    """The engine process of `rank` in the deployment whose coordinator listens on `rpc_port` (this host only)."""
    return _find_process("dpserve_engine.service", f"--coordinator\0tcp://127.0.0.1:{rpc_port}\0",
                         f"\0--rank\0{rank}\0")  # fmt: skip


def coordinator_pid(rpc_port: int) -> int | None:
    """The coordinator process listening on `rpc_port` (this host only)."""
    return _find_process("dpserve_coordinator.main", f"--data-parallel-rpc-port\0{rpc_port}\0")


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


class Deployment:
    """`dpserve serve` started for the benchmark (stopped at the end), or one given by --base-url."""

    log_prefix = "chaos"  # the started deployment's log: <log_dir>/<log_prefix>-serve-<port>.log

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.rpc_port = args.data_parallel_rpc_port or free_port()
        self.url = args.base_url.rstrip("/") if args.base_url else ""

    def start(self) -> None:
        if self.url:
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [os.path.join(os.path.dirname(sys.executable), "dpserve"), "serve", "--host", "127.0.0.1", "--port", str(port),
               "--data-parallel-size", str(self.args.data_parallel_size),
               "--data-parallel-backend", self.args.backend, "--data-parallel-rpc-port", str(self.rpc_port),
               *self.args.serve_args]  # fmt: skip
        os.makedirs(self.args.log_dir, exist_ok=True)  # --log-dir may name a folder not made yet
        self.log_path = os.path.join(self.args.log_dir, f"{self.log_prefix}-serve-{port}.log")
        _log(f"starting: dpserve {' '.join(cmd[1:])} (log {self.log_path})", self.log_prefix)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + self.args.startup_timeout_s
        while _get_json(self.url + "/health")[1].get("status") != "ok":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the deployment did not come up; see {self.log_path}")
            time.sleep(0.5)
        _log(f"serving at {self.url}", self.log_prefix)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def model(self) -> str:
        return _get_json(self.url + "/v1/models")[1]["data"][0]["id"]

    def serving_ranks(self) -> list[int]:
        return list(_get_json(self.url + "/health")[1].get("serving_ranks", []))

    def rank_serves(self, rank: int) -> bool:
        return _get_json(self.url + f"/health?rank={rank}", 2.0)[0] == 200

    def migrations(self) -> int:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "dpserve:request_migrations_total"))  # fmt: skip


# -- the load -------------------------------------------------------------------------------------------------------


async def _one(session, url: str, payload: bytes, phase: Phase, hung_s: float, deadline: float) -> None:
    import aiohttp

    phase.sent += 1
    outcome, tokens, error = "failed", 0, ""
    try:
        timeout = aiohttp.ClientTimeout(total=max(1.0, deadline + hung_s - time.monotonic()), sock_read=hung_s)
        async with session.post(url, data=payload, headers={"Content-Type": "application/json"},
                                timeout=timeout) as response:  # fmt: skip
            if response.status != 200:
                error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                done = False
                async for line in response.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: {"):
                        event = orjson.loads(line[6:])
                        if "error" in event:
                            error = event["error"].get("message", "error event")
                        if event.get("usage"):
                            tokens = event["usage"].get("completion_tokens", 0)
                if done and not error:
                    outcome = "ok"
                elif not error:
                    error = "the stream ended without [DONE]"
    except asyncio.TimeoutError:
        outcome, error = "hung", f"no byte for {hung_s:.0f} s or no end by the deadline"
    except aiohttp.ClientError as e:
        error = f"{type(e).__name__}: {e}"
    if outcome == "ok":
        phase.ok += 1
        phase.ok_tokens += tokens
    elif outcome == "hung":
        phase.hung += 1
    else:
        phase.failed += 1
    if error and len(phase.errors) < 10:
        phase.errors.append(error)


async def run_load(args, url: str, model: str, phase: Phase, on_start=None) -> None:
    """`concurrency` clients in a closed loop for `duration_s`; requests under way at the end run to completion."""
    import aiohttp

    started = time.monotonic()
    end = started + args.duration_s
    counter = iter(range(1 << 30))

    async def client(session) -> None:
        while time.monotonic() < end:
            i = next(counter)
            body = {"model": model, "prompt": f"Request {i}: tell a long story about a lighthouse keeper.",
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            await _one(session, url + "/v1/completions", orjson.dumps(body), phase, args.hung_s, end)

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.ensure_future(client(session)) for _ in range(args.concurrency)]
        if on_start is not None:
            tasks.append(asyncio.ensure_future(on_start(started, end)))
        await asyncio.gather(*tasks)
    phase.duration_s = time.monotonic() - started


# -- the faults -----------------------------------------------------------------------------------------------------


async def inject_faults(args, deployment: Deployment, faults: list[Fault], started: float, end: float) -> None:
    """Every fault_interval_s (the first after half of it): one random serving rank gets the fault; its timeline
    is followed until it serves again (or the load ends + 120 s)."""
    rng = random.Random(args.seed)
    followers = []
    next_at = started + args.fault_interval_s / 2
    while next_at < end:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        next_at += args.fault_interval_s
        if args.fault == "coordinator":
            followers.append(_kill_coordinator(deployment, faults, started, end))
            continue
        serving = await asyncio.to_thread(deployment.serving_ranks)
        pids = {r: engine_pid(deployment.rpc_port, r) for r in serving}
        candidates = [r for r, pid in pids.items() if pid is not None]
        if not candidates:
            _log("no serving rank to hit at this moment: skipped")
            continue
        rank = rng.choice(candidates)
        pid = pids[rank]
        target = _parent_pid(pid) if args.fault == "actor" else pid
        os.kill(target, signal.SIGSTOP if args.fault == "stop" else signal.SIGKILL)
        fault = Fault(rank, args.fault, pid, time.monotonic() - started)
        faults.append(fault)
        _log(f"{args.fault}: rank {rank} (pid {target}) at {fault.at_s:.1f} s")
        followers.append(asyncio.ensure_future(_follow(deployment, fault, started, end + 120)))
    await asyncio.gather(*followers)


def _kill_coordinator(deployment: Deployment, faults: list[Fault], started: float, end: float):
    pid = coordinator_pid(deployment.rpc_port)
    if pid is None:
        _log("no coordinator process found on this host: skipped")
        return asyncio.sleep(0)
    os.kill(pid, signal.SIGKILL)
    fault = Fault(-1, "coordinator", pid, time.monotonic() - started)
    faults.append(fault)
    _log(f"coordinator: SIGKILL to pid {pid} at {fault.at_s:.1f} s")
    return asyncio.ensure_future(_follow_coordinator(deployment, fault, started, end + 120))


async def _follow_coordinator(deployment: Deployment, fault: Fault, started: float, give_up: float) -> None:
    """Down: an API server says the coordinator is unreachable; back: it hears a new one (re-attached: it publishes
    only then, and the API server has registered with it)."""
    fault_at = started + fault.at_s
    while time.monotonic() < give_up:
        status = (await asyncio.to_thread(_get_json, deployment.url + "/status.json", 2.0))[1]
        reachable = status.get("coordinator", {}).get("reachable", False)
        now = time.monotonic()
        if not reachable and fault.down_after_s is None:
            fault.down_after_s = now - fault_at
        new_pid = coordinator_pid(deployment.rpc_port)
        # back: an API server hears the new coordinator (it said unreachable first: the old one's last broadcast
        # counts for COORDINATOR_SILENT_S)
        if reachable and fault.down_after_s is not None and new_pid not in (None, fault.pid):
            fault.recovery_s = now - fault_at
            _log(f"coordinator: reachable again {fault.recovery_s:.1f} s after the kill (pid {new_pid})")
            return
        await asyncio.sleep(0.1)


async def _follow(deployment: Deployment, fault: Fault, started: float, give_up: float) -> None:
    fault_at = started + fault.at_s
    while time.monotonic() < give_up:
        serves = await asyncio.to_thread(deployment.rank_serves, fault.rank)
        now = time.monotonic()
        if not serves and fault.down_after_s is None:
            fault.down_after_s = now - fault_at
        new_pid = engine_pid(deployment.rpc_port, fault.rank)
        if serves and fault.down_after_s is not None and new_pid not in (None, fault.pid):
            fault.recovery_s = now - fault_at
            _log(f"rank {fault.rank}: serving again {fault.recovery_s:.1f} s after the {fault.how} "
                 f"(seen down after {fault.down_after_s:.1f} s)")  # fmt: skip
            return
        await asyncio.sleep(0.1)


# -- the command ----------------------------------------------------------------------------------------------------


def _log(message: str, source: str = "chaos") -> None:
    print(f"[{source} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dpserve bench chaos", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--base-url", default=None, help="target this deployment instead of starting one (its "
                        "coordinator's --data-parallel-rpc-port is then needed to find the engines)")
    parser.add_argument("--data-parallel-rpc-port", type=int, default=None, help="the target's control port")
    parser.add_argument("--backend", choices=["ray", "mp"], default="ray", help="the started deployment's backend")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=2, help="the started deployment's ranks")
    parser.add_argument("--serve-args", default="", help="more flags for the started `dpserve serve`, one "
                        "string: --serve-args='--null-engine --null-step-time-ms 20'")
    parser.add_argument("--concurrency", type=int, default=16, help="clients in the closed loop")
    parser.add_argument("--duration-s", type=float, default=60.0, help="each phase's length (baseline, faulted)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--fault", choices=FAULTS, default="kill", help="what is done to the chosen rank")
    parser.add_argument("--fault-interval-s", type=float, default=20.0, help="one fault this often")
    parser.add_argument("--hung-s", type=float, default=30.0, help="no byte this long: the request hung")
    parser.add_argument("--seed", type=int, default=0, help="the choice of ranks")
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--log-dir", default="/tmp", help="the started deployment's log goes here")
    parser.add_argument("--output-json", default=None, help="every figure, both phases and each fault's timeline")
    return parser


async def _run(args, deployment: Deployment) -> dict:
    model = await asyncio.to_thread(deployment.model)
    phases = {}
    faults: list[Fault] = []
    for name in ("baseline", "faulted"):
        phase = Phase(name)
        before = await asyncio.to_thread(deployment.migrations)
        _log(f"{name}: {args.concurrency} clients for {args.duration_s:.0f} s"
             + (f", a {args.fault} every {args.fault_interval_s:.0f} s" if name == "faulted" else ""))  # fmt: skip

        async def faulting(started: float, end: float) -> None:
            await inject_faults(args, deployment, faults, started, end)

        await run_load(args, deployment.url, model, phase, faulting if name == "faulted" else None)
        phase.migrated = await asyncio.to_thread(deployment.migrations) - before
        _log(f"{name}: sent {phase.sent}, ok {phase.ok}, failed {phase.failed}, hung {phase.hung}, migrated "
             f"{phase.migrated}, {phase.goodput:.1f} ok output tok/s")  # fmt: skip
        phases[name] = phase
    return {"phases": phases, "faults": faults}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.serve_args = args.serve_args.split()
    if args.fault == "actor" and args.backend != "ray" and not args.base_url:
        raise SystemExit("--fault actor needs the ray backend")
    if args.base_url and not args.data_parallel_rpc_port:
        raise SystemExit("--base-url needs --data-parallel-rpc-port (to find the engine processes)")
    deployment = Deployment(args)
    try:
        deployment.start()
        out = asyncio.run(_run(args, deployment))
    finally:
        deployment.stop()
    base, hit, faults = out["phases"]["baseline"], out["phases"]["faulted"], out["faults"]
    recoveries = [f.recovery_s for f in faults]
    recovery_max = max((r for r in recoveries if r is not None), default=float("nan"))
    if any(r is None for r in recoveries):
        recovery_max = float("inf")  # a rank that never came back
    ratio = hit.goodput / base.goodput if base.goodput else 0.0
    if args.output_json:
        from dpserve.bench.report import machine

        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "machine": machine(),
                       "phases": {k: {**dataclasses.asdict(p), "goodput_tok_s": p.goodput} for k, p in
                                  out["phases"].items()},
                       "faults": [dataclasses.asdict(f) for f in faults], "goodput_ratio": ratio,
                       "recovery_s_max": recovery_max}, f, indent=1)  # fmt: skip
    print(f"chaos: sent={hit.sent} ok={hit.ok} migrated={hit.migrated} failed={hit.failed} hung={hit.hung} "
          f"recovery_s_max={recovery_max:.1f} goodput_ratio={ratio:.2f}", flush=True)  # fmt: skip
    return 0 if hit.failed == 0 and hit.hung == 0 else 1
