#!/usr/bin/env bash
# Build the llama.cpp peer for `python -m zen5 bench --peers` (issue 7), outside the repo.
#
# Source: the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python (PyPI is the one
# source registry this project reaches). Two builds of `llama-bench` only, both static:
#   avx512  AVX-512 F/BW/VL + VNNI/VBMI/BF16, no AMX: the instruction mix a Zen 5 core runs.
#   native  -DGGML_NATIVE=ON, which on this Xeon turns on AMX (tile, int8, bf16).
# The native build crashes here without a local fix (see ../shared/specs/cpu-performance-notes.md):
# GCC 12 drops the stores that fill the AMX tile configuration on the stack before `ldtilecfg`,
# because it cannot see the instruction read them. A compiler memory barrier on the struct just
# before `_tile_loadconfig` keeps them. The fix is applied to the extracted peer tree only; no
# llama.cpp code ever enters this repository.
#
# Idempotent: the download, the patch and each finished build are skipped when already there.
# Everything runs under `nice -n 19` because other work shares this 2-core machine.
# Usage: bash bench/build_peers.sh [PEER_DIR]   (default ${ZEN5_PEERS:-~/.cache/zen5/peers})
set -euo pipefail

VERSION=0.3.36
PEERS=${1:-${ZEN5_PEERS:-$HOME/.cache/zen5/peers}}
JOBS=${JOBS:-2}
SRC="$PEERS/llama_cpp_python-$VERSION/vendor/llama.cpp"
PY=${PYTHON:-python3}

mkdir -p "$PEERS"
cd "$PEERS"
if [ ! -d "$SRC" ]; then
  if [ ! -f "llama_cpp_python-$VERSION.tar.gz" ]; then
    nice -n 19 "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d .
  fi
  nice -n 19 tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi

# The AMX tile-config fix (one line, idempotent: marked with ZEN5-PEER-FIX).
MMQ="$SRC/ggml/src/ggml-cpu/amx/mmq.cpp"
if ! grep -q ZEN5-PEER-FIX "$MMQ"; then
  sed -i 's|^\(\s*\)_tile_loadconfig(&tc);|\1__asm__ __volatile__("" : : "r"(\&tc) : "memory");  /* ZEN5-PEER-FIX: keep the tc stores (GCC 12) */\n\1_tile_loadconfig(\&tc);|' "$MMQ"
  grep -q ZEN5-PEER-FIX "$MMQ" || { echo "build_peers: could not apply the AMX fix to $MMQ" >&2; exit 1; }
fi

COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_OPENMP=ON)
AVX512=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
        -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
        -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
NATIVE=(-DGGML_NATIVE=ON)

build() {  # build NAME CMAKE_ARGS...
  local name=$1; shift
  local dir="$PEERS/build-$name"
  if [ -x "$dir/bin/llama-bench" ]; then
    echo "build_peers: $name already built: $dir/bin/llama-bench"
    return
  fi
  nice -n 19 cmake -S "$SRC" -B "$dir" "${COMMON[@]}" "$@" > "$PEERS/build-$name.log" 2>&1
  nice -n 19 cmake --build "$dir" --target llama-bench -j "$JOBS" >> "$PEERS/build-$name.log" 2>&1 \
    || { echo "build_peers: $name failed, see $PEERS/build-$name.log" >&2; exit 1; }
  echo "build_peers: built $dir/bin/llama-bench"
}

build avx512 "${AVX512[@]}"
build native "${NATIVE[@]}"
