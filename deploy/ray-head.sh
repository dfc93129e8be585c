#!/bin/sh
# Start the Ray head on this container's address, then the coordinator attached to it.
# Env: DPSERVE_DP_SIZE (2), DPSERVE_DP_SIZE_LOCAL (0: no engine on the head), DPSERVE_RPC_PORT (29550),
#      DPSERVE_MODEL (smollm2), RAY_AUTH_MODE/RAY_AUTH_TOKEN (shared by every Ray node).
set -eu
# Ray runs workers at nice 15 by default; the engine ranks they host are the work, so they run at 0.
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
IP="$(hostname -i | awk '{print $1}')"
ray start --head --node-ip-address "$IP" --port 6379 --dashboard-host "$IP" --num-cpus "${RAY_HEAD_NUM_CPUS:-0}"
# The coordinator runs as a child (not exec'd), so that Ray is stopped after it: a stop signal goes to the
# coordinator (it drains and exits), then `ray stop` runs.
dpserve-coordinator \
  --ray-address auto \
  --data-parallel-address "$IP" \
  --data-parallel-rpc-port "${DPSERVE_RPC_PORT:-29550}" \
  --data-parallel-size "${DPSERVE_DP_SIZE:-2}" \
  --data-parallel-size-local "${DPSERVE_DP_SIZE_LOCAL:-0}" \
  --ray-wait-for-nodes-s "${DPSERVE_WAIT_FOR_NODES_S:-120}" \
  --status-port "${DPSERVE_STATUS_PORT:-8001}" \
  --model "${DPSERVE_MODEL:-smollm2}" "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' TERM INT
wait "$pid" || true
while kill -0 "$pid" 2>/dev/null; do  # a signal ends `wait` early: wait for the coordinator itself
  wait "$pid" || true
done
status=0
wait "$pid" || status=$?  # the coordinator's own exit status (the shell keeps it)
ray stop || true
exit "$status"
