#!/usr/bin/env bash
# GGUF files of the two seed models on a 24 GB card's memory, before downloading one: writes
# tools/gguf_stub.py files (real layout and llama.cpp's type mix, zero weights) and runs each
# through tools/bench_card_fit.py under --gpu-memory-gb 23.5 (the worker as `tokenpipe run`
# starts it): Gemma 4 31B Q4_K_M kept (auto) and --quantize int4, Q4_0 kept, all with one
# 8,192-token session; Qwen3.5-35B-A3B Q4_K_M kept with one 32,768-token session. Needs CUDA
# and ~60 GB of sparse-file room in $STUBS. Tables on stdout, JSON under $OUT (default ./out).
#
#   bash tools/bench_gguf_fit.sh            # all; or name some: g4auto g4int4 g4q40 qauto
set -uo pipefail
cd "$(dirname "$0")/.."
stubs="${STUBS:-/tmp}"
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(g4auto g4q40 g4int4 qauto)
stub() {  # stub CONFIG SCHEME FILE
  [ -e "$3" ] || python3 tools/gguf_stub.py --config "$1" --scheme "$2" --out "$3" || exit 1
}
for run in "${runs[@]}"; do
  start=$(date +%s)
  case "$run" in
    g4auto | g4int4)
      stub examples/gemma4_31b/config.json q4_k_m "$stubs/gemma4-31b-q4_k_m.gguf"
      quantize=(); [ "$run" = g4int4 ] && quantize=(--quantize int4)
      python3 tools/bench_card_fit.py --model "$stubs/gemma4-31b-q4_k_m.gguf" "${quantize[@]}" \
        --gpu-memory-gb 23.5 --context 8192 --new 32 --tag "$run" ;;
    g4q40)
      stub examples/gemma4_31b/config.json q4_0 "$stubs/gemma4-31b-q4_0.gguf"
      python3 tools/bench_card_fit.py --model "$stubs/gemma4-31b-q4_0.gguf" \
        --gpu-memory-gb 23.5 --context 8192 --new 32 --tag "$run" ;;
    qauto)
      stub examples/qwen3_5_moe/config.json q4_k_m "$stubs/qwen3_5-35b-a3b-q4_k_m.gguf"
      python3 tools/bench_card_fit.py --model "$stubs/qwen3_5-35b-a3b-q4_k_m.gguf" \
        --gpu-memory-gb 23.5 --context 32768 --new 32 --tag "$run" ;;
    *) echo "unknown run $run (g4auto g4int4 g4q40 qauto)" >&2; exit 2 ;;
  esac
  rc=$?
  echo "$run: exit $rc after $(($(date +%s) - start)) s"
done
