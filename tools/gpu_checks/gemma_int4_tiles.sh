# allot: 200
# dense4 (session 10, offline work; first round of the next session): the dense int4 GEMV's
# group-slot tiles and the 32-row GEMM's K split for more programs, on the Gemma 4 31B matrices.
# 1) kernels alone, weights rotated past L2 (per line: us, TB/s of the weight bytes, max error
#    relative to the largest output); the first gemv line / the programs-132 lines are today's.
# 2) through the worker with both switched on (the slot tiles are start-up candidates: the
#    timing keeps them only where they win; the GEMM splits K for 264 programs), then the tiles
#    the start-up chose. Compare: int4 1 session 103 tok/s, 32 sessions 1,565 (session 8-9).
set -x
timeout 95 python3 tools/bench_quant_kernels.py --tiles int4 \
  --only o_proj,qkv_proj,down_proj,gate_up_proj 2>&1 | grep -v Warning | tail -90
TOKENPIPE_CACHE=/tmp/d4c TOKENPIPE_QUANT_GEMV_SLOTS=1 TOKENPIPE_QUANT_GEMM_PROGRAMS=264 \
  timeout 100 python3 tools/bench_gpu.py --model examples/gemma4_31b --device cuda \
  --quantize int4 --sessions 1,32 --prefill "" --no-ttft --skip-hf --out /tmp/d4b 2>&1 \
  | grep '^| decode\|rror\|Traceback' | tail -8
python3 -c "import json; d = json.load(open('/tmp/d4c/kernels/quant_tiles.json'));
[print(k.split('|')[1:4], v) for k, v in d.items()]" 2>&1 | tail -8
