"""A/B of the frontend's hot path: one API server against null engines, a git revision of the frontend vs the tree.

    .venv/bin/python benchmarks/frontend_hot_path.py --base-rev HEAD --pairs 5

For each pair, in turn (base, then work): `dpserve serve --data-parallel-backend mp --data-parallel-size 2
--api-server-count 1 --null-engine --null-step-time-ms 0`, a warm-up, then `dpserve.bench_serve` at concurrency
32 (128 prompt / 64 output tokens); it records the output tok/s and the frontend process's CPU time (utime + stime
from /proc) during the measured run, per output token. The base is `services/frontend/dpserve_frontend` of
`--base-rev`, extracted with `git archive` into a temp dir and put first on PYTHONPATH (the working tree is not
touched); everything else (engines, coordinator, client) is the working tree's. Every process it starts is
stopped, by pid, before the next one starts. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "services/frontend/dpserve_frontend"


def extract_base(rev: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, PACKAGE], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "services/frontend"


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def frontend_pid(serve_pid: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == serve_pid and b"dpserve_frontend.main" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def bench(port: int, num_requests: int, endpoint: str, out: Path | None) -> dict | None:
    cmd = [sys.executable, "-m", "dpserve.bench_serve", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", endpoint, "--concurrency", "32", "--num-requests", str(num_requests),
           "--input-len", "128", "--output-len", "64", "--no-progress", "--quiet"]
    if out is not None:
        cmd += ["--output-json", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())["levels"][0] if out is not None else None


def one_run(label: str, pythonpath: str | None, port: int, args, workdir: Path) -> tuple[float, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(workdir / f"{label}.log", "wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "dpserve.cli", "serve", "--data-parallel-backend", "mp", "--data-parallel-size", "2",
         "--api-server-count", "1", "--null-engine", "--null-step-time-ms", "0", "--port", str(port),
         "--data-parallel-rpc-port", str(port + 1)],
        cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while b"dpserve: serving on" not in (workdir / f"{label}.log").read_bytes():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{label}: dpserve serve did not come up; see {workdir / label}.log")
            time.sleep(0.25)
        pid = frontend_pid(serve.pid)
        if pid is None:
            raise RuntimeError(f"{label}: no frontend process found")
        bench(port, 64, args.endpoint, None)  # warm-up
        before = cpu_ticks(pid)
        result = bench(port, args.num_requests, args.endpoint, workdir / f"{label}.json")
        used_s = (cpu_ticks(pid) - before) / os.sysconf("SC_CLK_TCK")
        if result["failed"]:
            raise RuntimeError(f"{label}: {result['failed']} requests failed")
        return result["output_throughput"], used_s / result["total_output_tokens"] * 1e6
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-rev", default="HEAD", help="git revision of the base frontend (default HEAD)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=1600)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--port", type=int, default=18900, help="HTTP port; the next one is the coordinator's")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fe-ab-") as tmp:
        workdir = Path(tmp)
        base_path = str(extract_base(args.base_rev, workdir / "base"))
        rows = []
        for i in range(1, args.pairs + 1):
            base = one_run(f"base-{i}", base_path, args.port, args, workdir)
            work = one_run(f"work-{i}", None, args.port, args, workdir)
            rows.append((base, work))
            print(f"pair {i}: base {base[0]:8.0f} tok/s {base[1]:5.1f} us CPU/tok | work {work[0]:8.0f} tok/s "
                  f"{work[1]:5.1f} us CPU/tok | tok/s x{work[0] / base[0]:.2f}, CPU/tok base/work "
                  f"x{base[1] / work[1]:.2f}", flush=True)
    med = statistics.median
    tput = [w[0] / b[0] for b, w in rows]
    cpu = [b[1] / w[1] for b, w in rows]
    print(f"median output tok/s: base {med(b[0] for b, _ in rows):.0f}, work {med(w[0] for _, w in rows):.0f}; "
          f"frontend CPU per output token: base {med(b[1] for b, _ in rows):.1f} us, "
          f"work {med(w[1] for _, w in rows):.1f} us")
    print(f"ratios: output tok/s work/base median {med(tput):.2f} (min {min(tput):.2f}, max {max(tput):.2f}); "
          f"CPU per token base/work median {med(cpu):.2f} (min {min(cpu):.2f}, max {max(cpu):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
