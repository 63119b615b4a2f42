#!/usr/bin/env bash
# Build the llama.cpp peers for `python -m zen5 bench --peers` (issue 7), outside the repo.
#
# Source: the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python (PyPI is the one
# source registry this project reaches). Builds of `llama-bench` only, all static, chosen from
# this CPU's /proc/cpuinfo flags (the same choice as bench/peers.py `planned_builds`):
#   native  -DGGML_NATIVE=ON, always: the CPU's best. With AMX (a Xeon since Sapphire Rapids) it
#           is the AMX build (tile, int8, bf16); on Zen 4/5 it is AVX-512 (+VNNI); on Zen 3 AVX2.
#   avx512  AVX-512 F/BW/VL + VNNI/VBMI/BF16, no AMX: the instruction mix a Zen 5 core runs.
#           Only where the CPU has AVX-512 AND AMX (elsewhere native already is this build).
#   avx2    AVX/AVX2/FMA/F16C/BMI2 and nothing newer (no AVX-512, AVX-VNNI or AMX): the peer of
#           zen5's AVX2 tier (`bench --isa avx2`). Only where the CPU has AVX-512 or AVX-VNNI (on
#           a CPU with neither, native is this build).
#   avx2vnni  the avx2 build plus AVX-VNNI (GGML_AVX_VNNI: llama.cpp's AVX2 dot products then use
#           vpdpbusd, as on Alder Lake and later): the peer of zen5's AVX2 + AVX-VNNI tier
#           (`bench --isa avx2vnni`). Only where the CPU has AVX-VNNI and AVX-512 (with AVX-VNNI
#           alone, native is this build).
# The native AMX build crashes without a local fix (see ../shared/specs/cpu-performance-notes.md):
# GCC 12 drops the stores that fill the AMX tile configuration on the stack before `ldtilecfg`,
# because it cannot see the instruction read them. A compiler memory barrier on the struct just
# before `_tile_loadconfig` keeps them. The fix is applied to the extracted peer tree only; no
# llama.cpp code ever enters this repository.
#
# Idempotent: the download, the patch and each finished build are skipped when already there.
# Everything runs under `nice -n 19` because other work shares this 2-core machine.
# Usage: bash bench/build_peers.sh [--plan] [--only NAME[,NAME]] [PEER_DIR]
#   PEER_DIR  default ${ZEN5_PEERS:-~/.cache/zen5/peers}
#   --plan    print the builds this CPU gets ("name" per line) and exit; ZEN5_CPU_FLAGS (a
#             space-separated flag list) stands in for /proc/cpuinfo (used by the tests)
#   --only    build only these of the planned builds (e.g. the one a recorded run needs first)
set -euo pipefail

VERSION=0.3.36
PLAN_ONLY=0
ONLY=""
PEERS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --plan) PLAN_ONLY=1 ;;
    --only) ONLY=${2:?--only needs a list}; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    -*) echo "build_peers: unknown option $1" >&2; exit 2 ;;
    *) PEERS=$1 ;;
  esac
  shift
done
PEERS=${PEERS:-${ZEN5_PEERS:-$HOME/.cache/zen5/peers}}
JOBS=${JOBS:-2}
SRC="$PEERS/llama_cpp_python-$VERSION/vendor/llama.cpp"
PY=${PYTHON:-python3}

# ------------------------------------------------------------------ which builds this CPU gets
FLAGS=" ${ZEN5_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)} "
has() { case "$FLAGS" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
HAS_AVX512=0; HAS_AMX=0; HAS_AVXVNNI=0
if has avx512f && has avx512bw && has avx512vl; then HAS_AVX512=1; fi
if has amx_tile && has amx_int8; then HAS_AMX=1; fi
if has avx_vnni; then HAS_AVXVNNI=1; fi
PLAN=(native)
if [ $HAS_AVX512 = 1 ] && [ $HAS_AMX = 1 ]; then PLAN+=(avx512); fi
if [ $HAS_AVX512 = 1 ] || [ $HAS_AVXVNNI = 1 ]; then PLAN+=(avx2); fi
if [ $HAS_AVX512 = 1 ] && [ $HAS_AVXVNNI = 1 ]; then PLAN+=(avx2vnni); fi
if [ $PLAN_ONLY = 1 ]; then
  printf '%s\n' "${PLAN[@]}"
  exit 0
fi
if ! has avx2 || ! has fma; then
  echo "build_peers: this CPU has no AVX2/FMA; the native build is the only peer" >&2
fi

mkdir -p "$PEERS"
cd "$PEERS"
if [ ! -d "$SRC" ]; then
  if [ ! -f "llama_cpp_python-$VERSION.tar.gz" ]; then
    nice -n 19 "$PY" -m pip download --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" -d .
  fi
  nice -n 19 tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi

# The AMX tile-config fix (one line, idempotent: marked with ZEN5-PEER-FIX). Harmless where the
# AMX code is not compiled.
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
AVX2=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
      -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
      -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
AVX2VNNI=("${AVX2[@]/-DGGML_AVX_VNNI=OFF/-DGGML_AVX_VNNI=ON}")
NATIVE=(-DGGML_NATIVE=ON)

build() {  # build NAME CMAKE_ARGS...
  local name=$1; shift
  local dir="$PEERS/build-$name"
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    return
  fi
  if [ -x "$dir/bin/llama-bench" ]; then
    echo "build_peers: $name already built: $dir/bin/llama-bench"
    return
  fi
  nice -n 19 cmake -S "$SRC" -B "$dir" "${COMMON[@]}" "$@" > "$PEERS/build-$name.log" 2>&1
  nice -n 19 cmake --build "$dir" --target llama-bench -j "$JOBS" >> "$PEERS/build-$name.log" 2>&1 \
    || { echo "build_peers: $name failed, see $PEERS/build-$name.log" >&2; exit 1; }
  echo "build_peers: built $dir/bin/llama-bench"
}

echo "build_peers: this CPU gets: ${PLAN[*]}"
for name in "${PLAN[@]}"; do
  case $name in
    native) build native "${NATIVE[@]}" ;;
    avx512) build avx512 "${AVX512[@]}" ;;
    avx2) build avx2 "${AVX2[@]}" ;;
    avx2vnni) build avx2vnni "${AVX2VNNI[@]}" ;;
  esac
done
