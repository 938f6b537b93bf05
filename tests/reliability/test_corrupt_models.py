"""Corrupt model files: a clear error at load, never a hang or a bare traceback.

In process, every corruption must raise `ModelLoadError` whose message names the file or the
mismatch. As a process, `tokenpipe worker` must exit non-zero within a bound, write one
structured `error` line on stdout, and say why on stderr without a Python traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import torch

from tests.reliability.helpers import CHILD_ENV, REPO, worker_argv, write_tiny_checkpoint

pytestmark = [pytest.mark.timeout(600)]

GGUF_PREFIX_BYTES = 1 << 20  # the start of the default GGUF (its metadata is longer)


def _truncate(path: Path, keep: float | int) -> None:
    data = path.read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else keep
    path.write_bytes(data[:size])


def _flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _wrong_tokenizer(directory: Path) -> None:
    from tests.conftest import byte_level_tokenizer_json

    (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json(300)))


Corruptor = Callable[[Path], Path]  # checkpoint dir -> the --model value to load


def _st(directory: Path) -> Path:
    return directory / "model.safetensors"


CHECKPOINT_CASES: dict[str, tuple[Corruptor, str]] = {
    # name: (corrupt the tiny checkpoint, a word the error message must contain)
    "safetensors truncated in the data": (
        lambda d: (_truncate(_st(d), 0.5), d)[1],
        "model.safetensors",
    ),
    "safetensors truncated in the header": (
        lambda d: (_truncate(_st(d), 100), d)[1],
        "model.safetensors",
    ),
    "safetensors empty": (lambda d: (_truncate(_st(d), 0), d)[1], "model.safetensors"),
    "safetensors header length flipped": (lambda d: (_flip(_st(d), 5), d)[1], "model.safetensors"),
    "safetensors header json flipped": (
        lambda d: (_flip(_st(d), 9, 0x40), d)[1],
        "model.safetensors",
    ),
    "config hidden_size does not match": (
        lambda d: (_edit_config(d, hidden_size=128), d)[1],
        "shape",
    ),
    "config has more layers than the weights": (
        lambda d: (_edit_config(d, num_hidden_layers=3), d)[1],
        "layers.2",
    ),
    "config vocab larger than the weights": (
        lambda d: (_edit_config(d, vocab_size=300), d)[1],
        "does not match",
    ),
    "config is not JSON": (lambda d: ((d / "config.json").write_text("{not json"), d)[1], "config"),
    "config unknown architecture": (
        lambda d: (_edit_config(d, architectures=["EvilForCausalLM"], model_type="evil"), d)[1],
        "Evil",
    ),
    "tokenizer larger than the embedding": (lambda d: (_wrong_tokenizer(d), d)[1], "vocab"),
    "tokenizer.json is not JSON": (
        lambda d: ((d / "tokenizer.json").write_text("]["), d)[1],
        "tokenizer",
    ),
    "no weights": (lambda d: (_st(d).unlink(), d)[1], "safetensors"),
    "path does not exist": (lambda d: d / "nope", "does not exist"),
}


def _gguf_prefix(directory: Path) -> Path:
    from worker.loading.default_model import default_model_path

    target = directory / "truncated.gguf"
    with open(default_model_path(), "rb") as source:
        target.write_bytes(source.read(GGUF_PREFIX_BYTES))
    return target


def _gguf_bad_magic(directory: Path) -> Path:
    target = _gguf_prefix(directory)
    _flip(target, 0)
    return target


def _gguf_bad_counts(directory: Path) -> Path:
    target = _gguf_prefix(directory)
    _flip(target, 8 + 7, 0x7F)  # the top byte of the tensor count: absurdly many tensors
    return target


def _gguf_empty(directory: Path) -> Path:
    target = directory / "empty.gguf"
    target.write_bytes(b"")
    return target


GGUF_CASES: dict[str, tuple[Corruptor, str]] = {
    "gguf truncated to 1 MB": (_gguf_prefix, ".gguf"),
    "gguf magic flipped": (_gguf_bad_magic, ".gguf"),
    "gguf tensor count flipped": (_gguf_bad_counts, ".gguf"),
    "gguf empty": (_gguf_empty, ".gguf"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pristine") / "ckpt")


def _corrupted(pristine: Path, tmp_path: Path, corrupt: Corruptor) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(pristine, directory)
    return corrupt(directory)


def test_pristine_checkpoint_loads(pristine: Path) -> None:
    from worker.loading.loader import load_model

    loaded = load_model(str(pristine), torch.device("cpu"), torch.float32)
    assert loaded.tokenizer.vocab_size == 263


@pytest.mark.parametrize("name", sorted(CHECKPOINT_CASES) + sorted(GGUF_CASES))
def test_corrupt_model_raises_model_load_error(
    name: str, pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.loading.loader import ModelLoadError, load_model

    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    corrupt, word = {**CHECKPOINT_CASES, **GGUF_CASES}[name]
    model = _corrupted(pristine, tmp_path, corrupt)
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_model(str(model), torch.device("cpu"), torch.float32)
    assert time.monotonic() - started < 60
    assert word.lower() in str(info.value).lower(), str(info.value)


PROCESS_CASES = [
    "safetensors truncated in the data",
    "config hidden_size does not match",
    "tokenizer larger than the embedding",
    "gguf truncated to 1 MB",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", PROCESS_CASES)
def test_worker_process_fails_cleanly(name: str, pristine: Path, tmp_path: Path) -> None:
    corrupt, word = {**CHECKPOINT_CASES, **GGUF_CASES}[name]
    model = _corrupted(pristine, tmp_path, corrupt)
    env = {**CHILD_ENV, "TOKENPIPE_CACHE": str(tmp_path / "cache")}
    import os

    result = subprocess.run(
        worker_argv("--model", str(model)),
        input=b"",
        capture_output=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, **env},
    )
    assert result.returncode != 0
    lines = [orjson.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout
    assert lines[0]["event"] == "error" and lines[0]["code"] and lines[0]["error"], lines
    assert word.lower() in lines[0]["error"].lower(), lines[0]
    stderr = result.stderr.decode(errors="replace")
    assert "Traceback (most recent call last)" not in stderr, stderr[-3000:]
    assert word.lower() in stderr.lower(), stderr[-3000:]
