#!/usr/bin/env bash
# Gemma 3 270M (Q4_K_M GGUF) on this machine: batch 1 and 8, speculation off vs on (n-gram k=5 and layer_skip),
# plain decode vs llama.cpp on the same file. The GGUF is Gemma-licensed and never shipped: pass its path, or
# let the slow test (tests/test_gemma3_real.py) assemble it into ~/.cache/specserve-tests first.
#   bash benchmarks/gemma3_270m.sh [GGUF] [LLAMA_CPP_DIR]   (~15 min on 2 cores)
# LLAMA_CPP_DIR: native llama.cpp binaries (benchmarks/build_llama_cpp.sh) for --peer llama.cpp on plain decode.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF="${1:-$HOME/.cache/specserve-tests/gemma-3-270m-q4_k_m.gguf}"
LLAMA_DIR="${2:-}"
[ -f "$GGUF" ] || { echo "no $GGUF: run '.venv/bin/python -m pytest tests/test_gemma3_real.py -k loads' first"; exit 1; }
COMMON=(--model "$GGUF" --num-prompts 8 --batch-sizes 1,8 --max-tokens 64 --repeats 2 --no-progress)
PEER=()
[ -n "$LLAMA_DIR" ] && PEER=(--peer llama.cpp --llama-cpp-dir "$LLAMA_DIR")
for ds in code chat; do
  echo "== $ds: n-gram k=5"
  .venv/bin/specserve bench offline "${COMMON[@]}" --dataset "$ds" --speculative-method ngram \
      --num-speculative-tokens 5 "${PEER[@]}"
  echo "== $ds: layer_skip (9 of 18 layers) k=3"
  .venv/bin/specserve bench offline "${COMMON[@]}" --dataset "$ds" --speculative-method layer_skip \
      --draft-layers 9 --num-speculative-tokens 3
done
