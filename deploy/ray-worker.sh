#!/bin/sh
# Join the Ray cluster at RAY_HEAD_ADDRESS (ray-head:6379) and host engine actors until stopped.
set -eu
# Ray runs workers at nice 15 by default; the engine ranks they host are the work, so they run at 0.
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
IP="$(hostname -i | awk '{print $1}')"
exec ray start --address "${RAY_HEAD_ADDRESS:-ray-head:6379}" --node-ip-address "$IP" \
  --num-cpus "${RAY_WORKER_NUM_CPUS:-2}" --block
