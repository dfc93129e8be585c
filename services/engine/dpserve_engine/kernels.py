"""The engine's own C++ ops (csrc/), built with the system's C++ compiler on first use and cached.

`torch.ops.dpserve.paged_decode_attention` (csrc/paged_attention.cpp): one-token attention that reads each
sequence's K/V where it lies in the paged cache. In the compiled decode step it replaces a gather of every
sequence's blocks (a copy), two batched matmuls over the padded width and a masked softmax: at batch 1 that was
~1.4 ms of a ~7 ms step here (docs/benchmarks.md).

`torch.ops.dpserve.q4_linear` / `q8_linear` (csrc/grouped_linear.cpp): the GGUF Q4_1 / Q8_0 groups against fp32
activations (kernel path "q4"); `q4q8_linear` / `q8q8_linear` (csrc/grouped_linear_q8.cpp): the same groups against
activations quantized to int8 per group inside the op (kernel path "q4q8"; cpu_paths.py).

Built like inductor builds its kernels, with the same compiler (`CXX`, default g++) and instruction-set flags
(inductor's pick of AVX512/AVX2/...), OpenMP as torch's own (the same libgomp, so one thread pool), against the
installed torch. The library is cached under `<cache_dir>/kernels/`, named by a hash of the source, the torch
version and the flags; it is written under a temporary name and renamed, so ranks that start together do not
see each other's half-written file. A build takes ~15-30 s on 2 cores; later starts load it in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # in the build key too
_lock = threading.Lock()
_loaded: str | None = None  # the loaded library's path


def load(cache_dir: str) -> str:
    """Build (if not cached) and load the ops; returns the library's path. Raises when it cannot be built."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = _build(Path(cache_dir) / "kernels")
            torch.ops.load_library(path)
            _register_fakes()
            _loaded = path
        return _loaded


def _flags(out_dir: Path) -> list[str]:
    """The compiler flags for this CPU: inductor's ISA pick, kept in `out_dir` per CPU and torch version, since
    importing inductor costs ~2 s of a rank's start-up (the compiled decode step imports it later, in the
    background, once the rank is serving)."""
    from dpserve_engine.cpu_paths import detect

    cpu = detect()
    key = hashlib.sha256(
        "\n".join([torch.__version__, cpu.capability, " ".join(sorted(cpu.flags))]).encode()
    ).hexdigest()[:16]
    path = out_dir / f"flags_{key}.json"
    try:
        flags = json.loads(path.read_text())
        if isinstance(flags, list) and all(isinstance(f, str) for f in flags):
            return flags
    except (OSError, ValueError):
        pass
    logger.info("choosing the kernels' compiler flags for this CPU (once per CPU and torch version)")
    flags = _inductor_flags()
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=out_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(flags, f)
    os.replace(tmp, path)
    return flags


def _inductor_flags() -> list[str]:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    flags = ["-O3", "-std=c++20", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp", "-Wno-unused-variable",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]  # fmt: skip
    if isa:  # e.g. CPU_CAPABILITY_AVX512 and its -m flags: what at::vec::Vectorized compiles to
        macros = isa.build_macro()
        flags += [f"-D{m}" for m in macros] + isa.build_arch_flags().split()
        flags.append(f"-DCPU_CAPABILITY={macros[0].removeprefix('CPU_CAPABILITY_')}")
    else:
        flags.append("-DCPU_CAPABILITY=DEFAULT")
    return flags


def _build(out_dir: Path) -> str:
    from torch.utils.cpp_extension import include_paths

    source = "\n".join(p.read_text() for p in [*_SOURCES, *_HEADERS])
    cxx = os.environ.get("CXX", "g++")
    flags = _flags(out_dir)
    key = hashlib.sha256("\n".join([source, torch.__version__, cxx, *flags]).encode()).hexdigest()[:16]
    out = out_dir / f"dpserve_kernels_{key}.so"
    if out.exists():
        return str(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *flags, *map(str, _SOURCES), *(f"-I{p}" for p in include_paths()), f"-L{lib_dir}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{lib_dir}", "-o", tmp]  # fmt: skip
    logger.info("building the engine's C++ kernels (once; cached in %s)", out_dir)
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {', '.join(p.name for p in _SOURCES)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("C++ kernels built in %.1f s", time.monotonic() - started)
    return str(out)


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (no data)."""

    @torch.library.register_fake("dpserve::paged_decode_attention")
    def _(q, k_cache, v_cache, block_table, positions, block_size, scale):
        return q.new_empty(q.shape)

    def grouped_linear(x, qs, d, m=None):  # every grouped op: x [M, K] -> [M, N], N = the weight's rows
        return x.new_empty(x.shape[0], qs.shape[0])

    for op in ("q4_linear", "q8_linear", "q4q8_linear", "q8q8_linear"):
        torch.library.register_fake(f"dpserve::{op}")(grouped_linear)
