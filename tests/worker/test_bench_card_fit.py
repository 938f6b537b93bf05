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
