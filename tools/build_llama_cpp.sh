#!/usr/bin/env bash
# Build llama.cpp's llama-bench from registry packages only (issue 20), for
# tools/bench_cpu_peers.py. The npm package node-llama-cpp ships the llama.cpp source as a git
# bundle; it is cloned and built natively (AVX-512 etc. of this CPU) with cmake.
#
#   tools/build_llama_cpp.sh            # -> .peers/llama.cpp/build/bin/llama-bench
#   JOBS=2 NODE_LLAMA_CPP_VERSION=3.22.1 tools/build_llama_cpp.sh
#
# Everything lands under .peers/ (git-ignored). Needs npm, git, cmake (apt install cmake or
# pip install cmake) and a C++ compiler. Re-running reuses what is there.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
peers="${PEERS_DIR:-$root/.peers}"
version="${NODE_LLAMA_CPP_VERSION:-3.22.1}"
jobs="${JOBS:-2}"
npm_dir="$peers/node-llama-cpp-$version"
src="$peers/llama.cpp"

for tool in npm git cmake c++; do
    command -v "$tool" >/dev/null || { echo "build_llama_cpp: '$tool' not found" >&2; exit 1; }
done
mkdir -p "$peers"

bundle="$npm_dir/node_modules/node-llama-cpp/llama/gitRelease.bundle"
if [ ! -f "$bundle" ]; then
    mkdir -p "$npm_dir"
    [ -f "$npm_dir/package.json" ] || echo '{"private": true}' >"$npm_dir/package.json"
    (cd "$npm_dir" && NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund \
        --omit=optional --ignore-scripts "node-llama-cpp@$version")
fi
[ -f "$bundle" ] || { echo "build_llama_cpp: no $bundle in node-llama-cpp $version" >&2; exit 1; }

if [ ! -d "$src/.git" ]; then
    git clone --quiet "$bundle" "$src"
fi
echo "llama.cpp source: $(git -C "$src" log -1 --format='%h %cd' --date=short)"

# ggml's AMX matmul (compiled in by -march=native on a CPU with AMX) segfaulted in llama-bench's
# first prompt on the dev VM (Xeon with amx_int8, 2026-12-01): AMX off; the rest stays native.
# gcc and clang let an explicit -mno-* win over -march=native whatever the order.
flags=""
if [ "$(uname -m)" = x86_64 ]; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=OFF \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$src/build" --target llama-bench -j "$jobs"
echo "built: $src/build/bin/llama-bench"
