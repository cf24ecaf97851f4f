#!/usr/bin/env bash
# Fuzz the C++ lossless Residual decoder under AddressSanitizer and UndefinedBehaviorSanitizer
# (fuzz/codec_fuzz.cpp): random parts encoded, then decoded from mutated bodies and Anchors.
# Usage: scripts/fuzz_codec.sh [seconds, default 60] [seed, default 46]. Exits non-zero on a
# sanitizer report or a body that does not round-trip. Needs g++ (x86-64-v3, as the codec).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${LYNX_FUZZ_BUILD:-build/fuzz}
mkdir -p "$out"
binary=$out/codec_fuzz
sources=(fuzz/codec_fuzz.cpp python/lynx/codec/csrc/cpu_codec_kernels.h python/lynx/codec/csrc/cpu_codec_lossless.h)
if [ ! -x "$binary" ] || [ -n "$(find "${sources[@]}" -newer "$binary")" ]; then
    ${CXX:-g++} -std=c++17 -O1 -g -march=x86-64-v3 -ffp-contract=off -fopenmp \
        -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
        fuzz/codec_fuzz.cpp -o "$binary"
fi
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    "$binary" "${1:-60}" "${2:-46}"
