"""With TOKENPIPE_RELIABILITY_WRITE=1, a run of this suite records one RELIABILITY.md row per
module (what it tried, how many tests passed), through tools/load_test.py's `update_row`."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# module -> (row key, what the module tries)
ROWS = {
    "test_bad_input.py": (
        "bad input (CI)",
        "the fixed corpus (~100 lines: invalid JSON/UTF-8, "
        "wrong types, NaN/Infinity, huge ints, bad token ids, 1 and 10 MB "
        "lines, unknown ops/fields, path fields, duplicate ids) + 120 "
        "hypothesis lines + 300-request open/close storm + 50 cancels of "
        "finished/unknown ids, into `tokenpipe worker` and `tokenpipe run` "
        "(default model, 512 context), a greedy probe alongside",
    ),
    "test_faults.py": (
        "faults (CI)",
        "kill -9 mid-prefill, kill -9 mid-decode, SIGSTOP "
        "(heartbeat 3 s), worker stdout closed, injected OOM in a forward; each "
        "with a named and an anonymous request in flight (tiny checkpoint)",
    ),
    "test_corrupt_models.py": (
        "corrupt models (CI)",
        "18 corruptions (safetensors truncated / "
        "header flipped / empty, config vs weights mismatches, wrong "
        "tokenizer size, bad JSON, GGUF truncated to 1 MB / magic / "
        "tensor count flipped / empty) in process, 4 as `tokenpipe "
        "worker` processes",
    ),
    "test_security.py": (
        "security (CI)",
        "session id validation (4 ops x ~45 ids), request "
        "structs with no path field, pickle/torch.load/yaml/trust_remote_code "
        "scan of every .py file, 20 hostile chat templates x worker and server "
        "renderers",
    ),
    "test_http.py": (
        "HTTP (CI)",
        "`tokenpipe serve --api-key`: 7 routes x 7 bad credentials, "
        "body limit (declared, chunked, lying Content-Length), 1 MB header and "
        "20,000 headers, loopback bind, 20 streaming clients with 7 disconnects",
    ),
    "test_load.py": (
        "load (CI)",
        "8 sessions x 3 requests through `tokenpipe run` (tiny "
        "checkpoint), 30% cancelled; greedy outputs vs run alone",
    ),
}

_outcomes: dict[str, Counter[str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = Path(report.nodeid.split("::")[0]).name
    if module not in ROWS:
        return
    counts = _outcomes.setdefault(module, Counter())
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            counts["xfailed (known bugs)"] += 1
        else:
            counts[report.outcome] += 1
    elif report.failed:
        counts["errors"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("TOKENPIPE_RELIABILITY_WRITE") != "1" or not _outcomes:
        return
    spec = importlib.util.spec_from_file_location("load_test", REPO / "tools" / "load_test.py")
    assert spec is not None and spec.loader is not None
    tool = sys.modules.get("load_test") or importlib.util.module_from_spec(spec)
    if "load_test" not in sys.modules:
        sys.modules["load_test"] = tool
        spec.loader.exec_module(tool)
    for module, counts in _outcomes.items():
        key, tried = ROWS[module]
        ok = counts["failed"] == 0 and counts["errors"] == 0 and counts["passed"] > 0
        held = ", ".join(f"{n} {what}" for what, n in sorted(counts.items()) if n)
        tool.update_row(key, f"pytest tests/reliability/{module}", tried, held, ok)
