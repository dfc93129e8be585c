#!/usr/bin/env bash
# guidellm (vLLM project's load generator) against dpserve, unchanged: its own venv, a local tokenizer exported from
# the served model, a dpserve server it starts and stops, and one guidellm run per request format.
#
#   benchmarks/guidellm.sh                 # real model (bundled SmolLM2 GGUF), DP=2 on mp, 6 requests per format
#   benchmarks/guidellm.sh --null-engine   # no model, 20 ms steps (the serving path only), 20 requests per format
#   benchmarks/guidellm.sh --null-engine -- --profile kind=sweep   # anything after -- goes to `guidellm run`
#
# Steps: (1) .bench-cache/guidellm-venv with CPU torch (TORCH_VERSION, default 2.13.0, installed first so that
# guidellm does not pull a CUDA build) and guidellm (GUIDELLM_VERSION, default: newest); (2)
# benchmarks/export_tokenizer.py writes the served model's tokenizer as a Hugging Face directory (guidellm's
# synthetic data needs one; no hub access); (3) `dpserve serve --data-parallel-backend mp` on free ports, in its
# own session, stopped by a trap on exit; (4) `guidellm run` with synthetic prompts for /v1/chat/completions and
# /v1/completions; its JSON and console output land in .bench-cache/guidellm-results/<UTC time>/. Exits 1 when a
# run failed or any request errored.
#
# Environment: PY (default .venv/bin/python), DP (2), MODEL (smollm2), REQUESTS (6 real / 20 null), STREAMS
# (concurrency, 2 real / 4 null), PROMPT_TOKENS (128), OUTPUT_TOKENS (64), FORMATS ("chat_completions completions"),
# SERVE_ARGS (extra `dpserve serve` flags; default for the real model: --max-num-batched-tokens 128, which keeps
# each engine step short on a busy 2-core machine), NICE (10), GUIDELLM_WORKERS (2: guidellm's worker processes).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$ROOT/.bench-cache"
PY="${PY:-$ROOT/.venv/bin/python}"
DPSERVE="$(dirname "$PY")/dpserve"
VENV="$CACHE/guidellm-venv"
NICE="${NICE:-10}"
MODEL="${MODEL:-smollm2}"
DP="${DP:-2}"
PROMPT_TOKENS="${PROMPT_TOKENS:-128}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-64}"
FORMATS="${FORMATS:-chat_completions completions}"

NULL_ENGINE=0
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --null-engine) NULL_ENGINE=1 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "usage: $0 [--null-engine] [-- GUIDELLM_RUN_ARGS...]" >&2; exit 2 ;;
    esac
    shift
done
if [ "$NULL_ENGINE" = 1 ]; then
    REQUESTS="${REQUESTS:-20}"; STREAMS="${STREAMS:-4}"
    read -r -a SERVE_EXTRA <<< "${SERVE_ARGS---null-engine --null-step-time-ms 20}"
    LABEL=null
else
    REQUESTS="${REQUESTS:-6}"; STREAMS="${STREAMS:-2}"
    read -r -a SERVE_EXTRA <<< "${SERVE_ARGS---max-num-batched-tokens 128}"
    LABEL=real
fi

# 1. guidellm in its own venv (it pulls transformers, datasets, torch: kept out of the project venv).
if [ ! -x "$VENV/bin/guidellm" ]; then
    echo "installing guidellm into $VENV" >&2
    python3 -m venv "$VENV"
    nice -n "$NICE" "$VENV/bin/pip" install -q "torch==${TORCH_VERSION:-2.13.0}"
    nice -n "$NICE" "$VENV/bin/pip" install -q "guidellm${GUIDELLM_VERSION:+==$GUIDELLM_VERSION}"
fi
GUIDELLM_VER="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("guidellm"))')"

# 2. The served model's tokenizer as a Hugging Face directory.
TOKENIZER="$CACHE/tokenizer-$(basename "$MODEL")"
nice -n "$NICE" "$PY" "$ROOT/benchmarks/export_tokenizer.py" "$TOKENIZER" --model "$MODEL"

# 3. dpserve, in its own session so that the trap stops it and everything it started.
read -r PORT RPC_PORT < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
OUT="$CACHE/guidellm-results/$(date -u +%Y%m%dT%H%M%SZ)-$LABEL"
mkdir -p "$OUT"
SERVER_PID=""
cleanup() {
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do
        # the session's live processes (dpserve serve, coordinator, engines, frontends); zombies do not count
        [ -z "$(ps -eo sid=,stat= | awk -v s="$SERVER_PID" '$1 == s && $2 !~ /^Z/')" ] && break
        sleep 1
    done
    pkill -KILL -s "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap cleanup EXIT
trap 'exit 130' INT TERM
setsid nice -n "$NICE" "$DPSERVE" serve --model "$MODEL" --data-parallel-backend mp --data-parallel-size "$DP" \
    --port "$PORT" --data-parallel-rpc-port "$RPC_PORT" "${SERVE_EXTRA[@]}" > "$OUT/dpserve.log" 2>&1 < /dev/null &
SERVER_PID=$!
for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "dpserve exited; see $OUT/dpserve.log" >&2; tail -20 "$OUT/dpserve.log" >&2; exit 1; }
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "dpserve not healthy after 300 s" >&2; exit 1; }

# 4. guidellm, once per request format.
echo "guidellm $GUIDELLM_VER against dpserve ($LABEL, DP=$DP) at http://127.0.0.1:$PORT; results in $OUT" >&2
status=0
for fmt in $FORMATS; do
    path="/v1/${fmt/_//}"  # chat_completions -> /v1/chat/completions
    cmd=("$VENV/bin/guidellm" run
        --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=$path"
        --tokenizer "kind=huggingface_auto,model=$TOKENIZER"
        --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS"
        --profile "kind=concurrent,streams=$STREAMS"
        --constraint "kind=max_requests,count=$REQUESTS"
        --output "kind=json,path=$OUT/$fmt.json" --output kind=console
        --disable-progress "${EXTRA[@]}")
    echo "+ ${cmd[*]}" | tee "$OUT/$fmt.cmd" >&2
    rc=0
    (cd "$OUT" && GUIDELLM__MAX_WORKER_PROCESSES="${GUIDELLM_WORKERS:-2}" nice -n "$NICE" "${cmd[@]}") \
        > "$OUT/$fmt.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ] || [ ! -f "$OUT/$fmt.json" ]; then
        echo "$fmt: guidellm failed (rc=$rc); see $OUT/$fmt.log" >&2
        grep -E "Error|error:" "$OUT/$fmt.log" | tail -5 >&2 || true
        status=1
        continue
    fi
    "$VENV/bin/python" - "$OUT/$fmt.json" "$fmt" <<'EOF' || status=1
import json, sys

path, fmt = sys.argv[1], sys.argv[2]
failed = False
for bench in json.load(open(path))["benchmarks"]:
    reqs = bench["requests"]
    counts = {k: len(reqs.get(k) or []) for k in ("successful", "errored", "incomplete")}
    metrics = bench["metrics"]

    def stat(name, field="median"):
        return metrics[name]["successful"][field]

    body = json.loads(reqs["successful"][0]["request_args"])["body"] if reqs.get("successful") else {}
    sent = {k: body[k] for k in ("stream_options", "ignore_eos", "max_tokens", "max_completion_tokens") if k in body}
    print(
        f"{fmt}: {counts['successful']} ok, {counts['errored']} errored, {counts['incomplete']} incomplete; "
        f"TTFT median {stat('time_to_first_token_ms'):.1f} ms, ITL median {stat('inter_token_latency_ms'):.1f} ms, "
        f"request latency median {stat('request_latency'):.2f} s, "
        f"{stat('output_tokens_per_second', 'mean'):.1f} output tok/s, {stat('requests_per_second', 'mean'):.2f} req/s; "
        f"sent {json.dumps(sent)}"
    )
    for err in {str((r.get("info") or {}).get("error")) for r in reqs.get("errored") or []}:
        print(f"  error: {err[:300]}")
    failed |= counts["errored"] > 0 or counts["incomplete"] > 0 or counts["successful"] == 0
sys.exit(1 if failed else 0)
EOF
done
if grep -E "missed heartbeats|dropped engine" "$OUT/dpserve.log" >&2; then
    echo "(dpserve dropped a rank during the run: see $OUT/dpserve.log)" >&2
fi
exit "$status"
