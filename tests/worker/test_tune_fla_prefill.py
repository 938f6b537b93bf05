"""tools/tune_fla_prefill.py's reading of the autotuners' choices (no GPU: the objects only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from tune_fla_prefill import _autotuner  # noqa: E402


@triton.heuristics({"EVEN": lambda args: args["n"] % 2 == 0})
@triton.autotune(configs=[triton.Config({}, num_warps=2)], key=["n"])
@triton.jit
def _under_heuristics(p, n, EVEN: tl.constexpr):  # fla's chunk state pass is built so
    pass


@triton.autotune(configs=[triton.Config({}, num_warps=2)], key=["n"])
@triton.jit
def _plain(p, n):
    pass


@triton.jit
def _not_tuned(p, n):
    pass


def test_finds_an_autotuner_under_heuristics() -> None:
    """Session 35: the tool read only bare autotuners, so it missed fla's state-pass kernel
    (heuristics outside its autotuner) and a first start still autotuned it (12 configs)."""
    from triton.runtime.autotuner import Autotuner

    assert not isinstance(_under_heuristics, Autotuner)
    assert _autotuner(_under_heuristics) is _under_heuristics.fn
    assert _autotuner(_plain) is _plain
    assert _autotuner(_not_tuned) is None
    assert _autotuner(len) is None


def _kept(root: Path, gpu: str, capability: str | None, kernels: dict[str, str]) -> Path:
    folder = root / gpu
    folder.mkdir(parents=True)
    if capability:
        (folder / "_device.json").write_text(json.dumps({"capability": capability}))
    for kernel, body in kernels.items():
        (folder / f"{kernel}.json").write_text(body)
    return folder


def test_a_gpu_borrows_the_kernels_it_lacks_from_one_of_its_capability(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 36: the H200's folder had only l2norm, so a first start on an H200 still
    autotuned fla's state pass (12 configs, ~12 s on an H100 before its files shipped). Files it
    lacks come from a kept GPU of the same compute capability; its own win; another
    capability's never (their configs may not launch there)."""
    from worker.layers.deltanet import fla_config_dir

    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    kept = tmp_path / "kept"
    h100 = _kept(kept, "H100", "9.0", {"l2norm": "h100 l2", "state": "h100 state"})
    h200 = _kept(kept, "H200", "9.0", {"l2norm": "h200 l2"})
    _kept(kept, "A100", "8.0", {"output": "a100 output"})

    merged = fla_config_dir(h200, "9.0", kept)
    assert merged == tmp_path / "cache" / "fla_configs" / "H200"
    files = {f.name: f.read_text() for f in merged.iterdir()}
    assert files == {"l2norm.json": "h200 l2", "state.json": "h100 state"}
    assert fla_config_dir(h100, "9.0", kept) == h100  # nothing to borrow: the shipped folder
    assert fla_config_dir(kept / "L40S", "8.9", kept) is None  # no kept choice applies
    assert fla_config_dir(kept / "GH200", "9.0", kept) == tmp_path / "cache" / "fla_configs" / (
        "GH200"
    )  # no folder of its own: all the H100's (the first of its capability by name)

    (h200 / "state.json").write_text("h200 state")  # tuned on the H200 later: its own wins,
    assert fla_config_dir(h200, "9.0", kept) == h200  # and the merge is no longer read
    (h100 / "extra.json").write_text("h100 extra")
    merged = fla_config_dir(h200, "9.0", kept)
    assert sorted(f.name for f in merged.iterdir()) == ["extra.json", "l2norm.json", "state.json"]
    assert (merged / "state.json").read_text() == "h200 state"


def test_a_read_only_cache_keeps_the_gpus_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.layers.deltanet import fla_config_dir

    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("TOKENPIPE_CACHE", str(blocked))  # its folders cannot be made
    kept = tmp_path / "kept"
    _kept(kept, "H100", "9.0", {"state": "h100 state"})
    h200 = _kept(kept, "H200", "9.0", {"l2norm": "h200 l2"})
    assert fla_config_dir(h200, "9.0", kept) == h200
    assert fla_config_dir(kept / "GH200", "9.0", kept) is None


def test_the_shipped_folders_name_their_capability() -> None:
    """Every kept folder says its GPU's capability, or no other GPU could borrow from it."""
    from worker.layers.deltanet import FLA_CONFIGS, FLA_DEVICE_FILE

    folders = [f for f in FLA_CONFIGS.iterdir() if f.is_dir()]
    assert folders
    for folder in folders:
        device = json.loads((folder / FLA_DEVICE_FILE).read_text())
        assert set(device) == {"capability", "name"}, folder
        assert device["capability"].replace(".", "").isdigit(), folder
