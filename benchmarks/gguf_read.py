"""Reading a GGUF file's metadata and tensor index: dpserve_engine.gguf_metadata against gguf-py's GGUFReader, side by
side, alternating, on the bundled SmolLM2 and (when installed: `make gemma`) Gemma 3 270M's 262k vocabulary.

    .venv/bin/python benchmarks/gguf_read.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf

from dpserve_engine.gguf_metadata import read_gguf, read_gguf_metadata
from dpserve_engine.model_files import bundled_gguf_path, optional_gemma_path


def seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for path in filter(None, [bundled_gguf_path(), optional_gemma_path()]):
        times = {"GGUFReader": [], "read_gguf_metadata": [], "read_gguf": []}
        for _ in range(args.rounds):
            times["GGUFReader"].append(seconds(lambda: gguf.GGUFReader(path)))
            times["read_gguf_metadata"].append(seconds(lambda: read_gguf_metadata(path)))
            times["read_gguf"].append(seconds(lambda: read_gguf(path)))
        print(path.rsplit("/", 1)[-1], {k: f"{statistics.median(v):.2f} s" for k, v in times.items()})


if __name__ == "__main__":
    main()
