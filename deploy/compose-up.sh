#!/bin/sh
# docker-compose up for dpserve, after checking what compose would otherwise report in an environment dump.
# Usage: deploy/compose-up.sh [docker-compose up args...], e.g. --scale ray-worker=2 --scale frontend=2
# Env: RAY_AUTH_TOKEN (required: the Ray cluster's shared secret), DPSERVE_CLUSTER_KEY (required: the ZMQ
#      sockets' CURVE key, shared by the coordinator and the frontends), TORCH_INDEX_URL (the engine image's torch
#      wheel index: the CPU build by default; a CUDA index such as https://download.pytorch.org/whl/cu128 for GPUs).
set -eu
if [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  echo "error: RAY_AUTH_TOKEN is not set: export RAY_AUTH_TOKEN=\$(openssl rand -hex 32) (the same value on every Ray node)" >&2
  exit 2
fi
if [ -z "${DPSERVE_CLUSTER_KEY:-}" ]; then
  echo "error: DPSERVE_CLUSTER_KEY is not set: export DPSERVE_CLUSTER_KEY=\$(openssl rand -hex 32) (the ZMQ sockets' shared key)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
exec docker-compose up "$@"
