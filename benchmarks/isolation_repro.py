"""Issue #20's reproduction matrix: deployments one after another and side by side on one host, run against any
checkout of dpserve (this one, or the code the report was made on), with a burst of 40 completions on each.

    .venv/bin/python benchmarks/isolation_repro.py                       # every scenario, null engines, this tree
    .venv/bin/python benchmarks/isolation_repro.py --tree /work/old kill  # one scenario against another checkout
    .venv/bin/python benchmarks/isolation_repro.py --model midstart        # the real model (slower starts)

Scenarios (all `dpserve serve -dp 2 --api-server-count 2`, the ray backend and default ports unless named):
- kill:      A serving, SIGKILL to A's `dpserve serve`, B started at once (retried as a user would while A's port
             is taken).
- killcoord: A serving, SIGKILL to A's coordinator only (its engines, Ray and API servers left to notice; a
             `dpserve serve` that restarts its coordinator is burst-checked and stopped), then B.
- midstart:  A stopped with SIGINT while its ranks load, B started at once and retried.
- side:      A (ray, default ports) and B (mp, ports 29560/8001) side by side, then A stopped while C starts on
             A's ports; bursts on both live deployments before and after.

Each deployment logs to its own file under --out; the report lists per deployment the lines that would show a rank
lost (a drain nobody asked for, an unregistration, a refusal, a replacement) and, per burst, the requests each rank
served (from `vllm:request_success_total{engine=...}`) and /health. A scenario "reproduces" #20 when a burst is not
served by both ranks of its deployment, or a rank of a deployment that was not being stopped drains or unregisters.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from dpserve.bench.metrics import engine_metrics

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("shared", "services/engine", "services/coordinator", "services/frontend", "")
TROUBLE = re.compile(r"shutting down: draining|unregistered|replacement|refused|DEAD|already served|cannot bind|"
                     r"in use", re.I)  # fmt: skip
BURST = 40


class Matrix:
    def __init__(self, tree: str, out: str, model: bool):
        self.tree, self.out, self.model = tree, out, model
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = ":".join(os.path.join(tree, p) for p in PACKAGES)
        self.failures: list[str] = []
        os.makedirs(out, exist_ok=True)

    def log(self, message: str) -> None:
        print(time.strftime("%H:%M:%S"), message, flush=True)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "dpserve.cli", "serve", "--data-parallel-size", "2", "--api-server-count", "2",
               *([] if self.model else ["--null-engine"]), *args]  # fmt: skip
        log = open(os.path.join(self.out, f"{name}.log"), "w")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tree,
                                start_new_session=True)  # fmt: skip
        proc.name = name  # type: ignore[attr-defined]
        self.log(f"started {name} (pid {proc.pid}) {' '.join(args)}")
        return proc

    def text(self, name: str) -> str:
        with open(os.path.join(self.out, f"{name}.log"), errors="replace") as f:
            return f.read()

    def ready(self, proc: subprocess.Popen, timeout_s: float = 400) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "dpserve: serving on" in self.text(proc.name):
                self.log(f"{proc.name} ready")
                return True
            if proc.poll() is not None:
                self.log(f"{proc.name} exited with code {proc.returncode}")
                return False
            time.sleep(0.3)
        return False

    def start_retrying(self, name: str, *args: str, tries: int = 30) -> subprocess.Popen:
        """As a user would: start, and start again while the previous deployment still holds the ports."""
        for attempt in range(tries):
            proc = self.start(f"{name}{attempt}", *args)
            if self.ready(proc):
                return proc
            time.sleep(1.0)
        raise RuntimeError(f"{name} did not start in {tries} tries")

    def signal(self, proc: subprocess.Popen, sig: int, wait: bool = True) -> None:
        self.log(f"{signal.Signals(sig).name} to {proc.name}")
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            return
        if wait:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def bursts(self, *ports: int) -> None:
        threads = [threading.Thread(target=self.burst, args=(port,)) for port in ports]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def burst(self, port: int) -> None:
        url = f"http://127.0.0.1:{port}"
        model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=10))["data"][0]["id"]
        before, statuses = _successes(url), []

        def one(i: int) -> None:
            body = json.dumps({"model": model, "prompt": f"request {i}", "max_tokens": 8}).encode()
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    statuses.append(response.status)
            except Exception as e:  # noqa: BLE001 - reported
                statuses.append(getattr(e, "code", None) or type(e).__name__)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        after = _successes(url)
        served = {rank: after.get(rank, 0) - before.get(rank, 0) for rank in sorted(set(after) | set(before))}
        health = json.load(urllib.request.urlopen(url + "/health", timeout=10))
        counts = {s: statuses.count(s) for s in set(statuses)}
        self.log(f"burst on :{port}: {counts}, served per rank {served}, health {health.get('status')} "
                 f"{health.get('serving_ranks')}")  # fmt: skip
        if counts != {200: BURST} or len([v for v in served.values() if v]) < 2:
            self.failures.append(f"burst on :{port} at {time.strftime('%H:%M:%S')}: {counts}, per rank {served}")

    def report(self) -> None:
        """Each deployment's lines that would show a rank lost (read them against the scenario's own stops)."""
        for name in sorted(f[:-4] for f in os.listdir(self.out) if f.endswith(".log")):
            lines = [line.rstrip() for line in self.text(name).splitlines() if TROUBLE.search(line)]
            print(f"--- {name}: {len(lines)} line(s)")
            for line in lines[:20]:
                print("   ", re.sub(r"\x1b\[[0-9;]*m", "", line)[:200])

    def replacement(self, settle_s: float) -> None:
        """Deployment B on the default ports as soon as they are free: a burst, `settle_s` for a stray Shutdown or
        drain to land, another burst, then B stopped."""
        b = self.start_retrying("B")
        self.bursts(8000)
        time.sleep(settle_s)
        self.bursts(8000)
        self.signal(b, signal.SIGTERM)

    # -- scenarios ---------------------------------------------------------------------------------------------------

    def kill(self) -> None:
        a = self.start("A")
        self.ready(a)
        self.burst(8000)
        self.signal(a, signal.SIGKILL, wait=False)
        self.replacement(settle_s=15)

    def killcoord(self) -> None:
        a = self.start("A")
        self.ready(a)
        self.burst(8000)
        children = subprocess.run(["pgrep", "-P", str(a.pid), "-f", "dpserve_coordinator"], capture_output=True,
                                  text=True).stdout.split()  # fmt: skip
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        self.log(f"SIGKILL to A's coordinator {children}")
        try:
            a.wait(20)
        except subprocess.TimeoutExpired:  # `dpserve serve` restarts a coordinator that dies once serving (#16)
            time.sleep(10)
            self.burst(8000)
            self.signal(a, signal.SIGTERM)
        self.replacement(settle_s=20)

    def midstart(self) -> None:
        a = self.start("A")
        time.sleep(12 if self.model else 2)
        self.signal(a, signal.SIGINT, wait=False)
        self.replacement(settle_s=20)

    def side(self) -> None:
        a = self.start("A")
        self.ready(a)
        b = self.start("B", "--data-parallel-backend", "mp", "--data-parallel-rpc-port", "29560", "--port", "8001")
        self.ready(b)
        self.bursts(8000, 8001)
        self.signal(a, signal.SIGINT, wait=False)
        c = self.start_retrying("C")
        self.bursts(8000, 8001)
        time.sleep(15)
        self.bursts(8000, 8001)
        self.signal(c, signal.SIGTERM)
        self.signal(b, signal.SIGTERM)


def _successes(url: str) -> dict[int, float]:
    """Requests each rank finished, from the deployment's /metrics."""
    return engine_metrics(url).get("vllm:request_success_total", {})


SCENARIOS = ("kill", "killcoord", "midstart", "side")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--tree", default=HERE, help="the dpserve checkout to run (default: this one)")
    parser.add_argument("--model", action="store_true", help="the bundled model instead of null engines")
    parser.add_argument("--out", default=f"/tmp/dpserve-isolation-{int(time.time())}", help="log directory")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}: choose from {', '.join(SCENARIOS)}")
    failed = []
    for scenario in args.scenarios or SCENARIOS:
        matrix = Matrix(args.tree, os.path.join(args.out, scenario), args.model)
        print(f"=== {scenario} ({args.tree}{', model' if args.model else ', null engines'})", flush=True)
        getattr(matrix, scenario)()
        time.sleep(3)
        matrix.report()
        failed += [f"{scenario}: {f}" for f in matrix.failures]
    print("\n".join(failed) if failed else "not reproduced: every burst served in full by both ranks", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
