"""The protocol's timing contract and the limits every side checks alike, in one place.

What one side sends at a rate, another side tolerates the silence of: the numbers must agree, so the frontend,
the engine and the coordinator all read them from here (their flags and settings take these as defaults).
"""

HEARTBEAT_INTERVAL_S = 1.0  # frontends and engines -> coordinator, whatever else they are doing
# coordinator: an engine with requests whose step counter has not moved this long is stuck (killed, replaced). The
# longest legal step is one prefill chunk of --max-num-batched-tokens (512 by default) at the longest context:
# about a second on a 2-core AVX2 machine (~0.28 s per 128 tokens), more beside a cold start's compile; 60 s
# leaves a wide margin (a model 10 x larger with 4 x the chunk still fits). Otherwise: --engine-stall-timeout-s.
ENGINE_STALL_S = 60.0
# coordinator: an engine without a heartbeat this long is DEAD, and killed if the coordinator started it (a stopped
# or hung process). Heartbeats come every 1 s from a thread of their own (coordinator_link.py), which torch's ops
# and the compile's tracing (at a 20 us switch interval) leave the GIL to; 5 s is five missed in a row.
ENGINE_SILENCE_S = 5.0
FRONTEND_SILENCE_S = 5.0  # coordinator: a frontend without a heartbeat this long is gone (FrontendGone broadcast)
TOPOLOGY_REPUBLISH_S = 2.0  # coordinator: the Topology is broadcast at least this often, changed or not
MODEL_REPUBLISH_S = 30.0  # ... and with the model (ModelInfo, its tokenizer MBs) on a change and this often
LOAD_MIN_INTERVAL_S = 0.1  # coordinator: a LoadSnapshot at most this often after a change...
LOAD_HEARTBEAT_S = 1.0  # ...and at least this often without one
COORDINATOR_SILENCE_S = 5.0  # frontends, engines: no broadcast this long -> register again (a restarted coordinator)
STATS_MIN_INTERVAL_S = 0.05  # engine: EngineStats at most this often when its routing-relevant load changes
COUNTERS_INTERVAL_S = 1.0  # engine: EngineStats with the cumulative counters at least this often
ENGINE_DRAIN_S = 5.0  # engine: Shutdown(drain=True) lets running requests finish this long, then aborts them

MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit): the frontend refuses more, the engine too
EXPERT_GROUP_TIMEOUT_S = 120.0  # an expert-parallel rank's join, and each collective, gives up after this long
