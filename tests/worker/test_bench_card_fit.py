"""tools/bench_card_fit.py's dry run on the CPU: a real worker process, the untimed warm-up
request in the spare slot, then the named session filled to the context and decoded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_warms_up_then_fills_the_session(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "tools" / "bench_card_fit.py"), "--tiny",
               "--device", "cpu", "--context", "256", "--new", "8", "--warmup", "300",
               "--tag", "dry", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "bench_card_fit_1x256_dry.json").read_text())
    assert result["warmup_s"] > 0  # 300 asked, held to the context
    (run,) = result["runs"]
    assert run["prompt_tokens"] == 256 - 8 - 1 and run["prefill_tok_s"] > 0
    assert result["after_runs"]["sessions"] == 1  # the warm-up left no session behind


def test_checkpoint_written_then_quantized_at_load(tmp_path: Path) -> None:
    """`--checkpoint DIR`: the random weights go to a sharded bf16 safetensors checkpoint first,
    and the worker loads those files (no `--random-weights`), quantizing them as they stream in;
    a second run reuses the files."""
    import torch
    from safetensors import safe_open

    where = tmp_path / "ck"
    command = [sys.executable, str(REPO / "tools" / "bench_card_fit.py"), "--tiny",
               "--device", "cpu", "--context", "128", "--new", "4", "--warmup", "0",
               "--quantize", "int8", "--checkpoint", str(where),
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--random-weights" not in done.stderr and f"loading {where}" in done.stderr
    assert "[tokenpipe quantize] weights on cpu: int8 g32" in done.stderr
    index = json.loads((where / "model.safetensors.index.json").read_text())
    (file,) = set(index["weight_map"].values())
    with safe_open(str(where / file), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert q.dtype == norm.dtype == torch.bfloat16
    assert 0.015 < float(q.float().std()) < 0.025  # --random-weights' N(0, 0.02)
    assert set(norm.float().tolist()) == {1.0}  # gemma4's norms at their identity
    again = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0 and "already written" in again.stderr
