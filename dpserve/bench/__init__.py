"""`dpserve bench serve`, one job per module: `metrics` (definitions and computation), `client` (the streamed
request), `prompts` (synthetic prompts), `runner` (one load level), `report` (text, plot), `serve` (the command
line). `python -m dpserve.bench_serve` runs `serve.main`."""
