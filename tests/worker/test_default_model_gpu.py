"""The real default model on the GPU (`--device cuda`) continues the reference prompts with
the same greedy tokens as on the CPU: two real worker processes, fp32 on both, the GPU one
with its whole CUDA path (merged projections, Triton kernels, CUDA graphs, decode ahead).
bf16 on the GPU is reported, not asserted. Needs CUDA and the default model (or a GGUF file
named by TOKENPIPE_TEST_GGUF): the GPU box has no network, so the file is brought over."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from test_default_model import NEW_TOKENS, PROMPTS

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model_path() -> str:
    if os.environ.get("TOKENPIPE_TEST_GGUF"):
        return os.environ["TOKENPIPE_TEST_GGUF"]
    from worker.loading.checkpoint import ModelLoadError
    from worker.loading.default_model import default_model_path

    try:
        return str(default_model_path())
    except ModelLoadError as exc:
        pytest.skip(f"no default model here: {exc}")


def _greedy_tokens(model: str, device: str, dtype: str) -> list[list[int]]:
    argv = [sys.executable, "-m", "worker.main", "--model", model, "--device", device,
            "--dtype", dtype, "--max-sessions", "2", "--max-context", "512"]  # fmt: skip
    if device == "cpu":
        argv += ["--threads", str(min(8, os.cpu_count() or 1))]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready = orjson.loads(proc.stdout.readline())
        assert ready.get("ready"), ready
        out = []
        for i, prompt in enumerate(PROMPTS):
            request: dict[str, Any] = {"id": i, "prompt": prompt, "max_new_tokens": NEW_TOKENS,
                                       "temperature": 0, "stop_token_ids": []}  # fmt: skip
            proc.stdin.write(orjson.dumps(request) + b"\n")
            proc.stdin.flush()
            while True:
                event = orjson.loads(proc.stdout.readline())
                if event.get("event") in ("done", "error") or "error" in event:
                    break
            assert event.get("event") == "done", event
            out.append(event["generated_token_ids"])
        return out
    finally:
        proc.stdin.close()
        proc.wait(120)


def test_default_model_gpu_greedy_equals_cpu() -> None:
    model = _model_path()
    cpu = _greedy_tokens(model, "cpu", "float32")
    gpu = _greedy_tokens(model, "cuda", "float32")
    bf16 = _greedy_tokens(model, "cuda", "bfloat16")
    agree = [_common_prefix(x, y) for x, y in zip(cpu, bf16, strict=True)]
    print(f"bf16 GPU vs fp32 CPU: leading greedy tokens equal per prompt {agree} "
          f"(of {[len(t) for t in cpu]})")  # fmt: skip
    assert all(0 < len(t) <= NEW_TOKENS for t in cpu)
    assert gpu == cpu


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
