#!/usr/bin/env bash
# The llama.cpp peer for `specserve bench offline --peer llama.cpp` and benchmarks/vs_llama_cpp.py:
# llama-cpp-python built from source into its own venv (never a dependency of specserve).
#   bash benchmarks/build_llama_cpp.sh [VENV]        # default /tmp/llama-venv; ~10 min on 2 cores
# Portable x86 build: AVX2 + FMA + F16C, AVX-512 where this CPU has it, no AMX (GGML_NATIVE off so the
# binary does not depend on the build machine's exact flags).
set -euo pipefail
venv=${1:-/tmp/llama-venv}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
cmake_args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
if grep -qw avx512f /proc/cpuinfo; then cmake_args+=" -DGGML_AVX512=ON"; else cmake_args+=" -DGGML_AVX512=OFF"; fi
python3 -m venv "$venv"
CMAKE_ARGS="$cmake_args" "$venv/bin/pip" install -q "llama-cpp-python==$version"
"$venv/bin/python" -c "import llama_cpp, sys; print('llama-cpp-python', llama_cpp.__version__, 'in', sys.prefix)"
