"""`python -m dpserve.bench_serve`: runs `dpserve bench serve` (dpserve/bench/serve.py)."""

from __future__ import annotations

import sys

from dpserve.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
