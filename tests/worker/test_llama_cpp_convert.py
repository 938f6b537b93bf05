"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``) load as the models
they came from: a tiny Llama, Gemma 4 and Qwen3.5-MoE (with and without a multi-token-prediction
block), F32 and Q8_0, against transformers (tools/check_llama_cpp_convert.py; its docstring has the
criteria). The other GGUF tests write their files the way the converter does; this one runs it.

It needs a llama.cpp source tree: ``$TOKENPIPE_LLAMA_CPP``, else ``.peers/llama.cpp``
(tools/build_llama_cpp.sh). Without one the test is skipped, unless
``TOKENPIPE_REQUIRE_LLAMA_CPP=1`` (``.ci/run`` sets it once it has unpacked the converter from
llama-cpp-python's source package): then it fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

pytest.importorskip("transformers")
pytest.importorskip("gguf")


def llama_cpp() -> Path:
    tree = Path(os.environ.get("TOKENPIPE_LLAMA_CPP") or REPO / ".peers" / "llama.cpp")
    if not (tree / "convert_hf_to_gguf.py").is_file():
        reason = f"no llama.cpp source tree at {tree} (TOKENPIPE_LLAMA_CPP; .ci/run unpacks one)"
        if os.environ.get("TOKENPIPE_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return tree


@pytest.mark.slow
def test_llama_cpp_converted_files_load_as_their_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from check_llama_cpp_convert import check, table

    tree = llama_cpp()
    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    rows = check(tree, tmp_path)
    assert len(rows) == 8  # llama, gemma4: f32, q8_0; qwen35moe: the same without and with MTP
    assert all(row["ok"] for row in rows), table(rows)
