"""Shared fixtures.

- `default_model_dir`: the default model (Gemma 3 270M GGUF) converted once into its cache
  directory (the real cache, so later sessions reuse it; `TOKENPIPE_CACHE` moves it).
- `tiny_checkpoint_factory`: writes a tiny random HF checkpoint directory (llama or gemma3
  config, safetensors, a byte-level tokenizer.json) for fast loader tests.
- `hf_gguf_oracle`: transformers' own reading of the default GGUF (config + dequantized fp32
  state dict), built once per session for the tests that compare against it.
- `triton_ready`: Triton for the kernel tests, compiled for CUDA or, without a GPU, run by
  Triton's CPU interpreter (TRITON_INTERPRET=1, set here before anything imports triton).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

# CI runs the property tests on a fixed sequence of examples (same inputs every run, so a red
# CI is a real regression, never a lucky draw); locally they explore new inputs each run.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before
# triton is first imported. Only the kernel tests reach Triton on the CPU: the worker's CPU
# path never does (`use_triton` wants CUDA tensors unless TOKENPIPE_TRITON_CPU=1).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_ready() -> None:
    """Triton imports, and on a machine without CUDA its interpreter is on. Otherwise a skip,
    or a failure under TOKENPIPE_REQUIRE_TRITON=1 (CI, where a skipped kernel test hides a
    broken kernel)."""
    problem = None
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except Exception as exc:  # ImportError, or an install without a usable backend
        problem = f"triton does not import: {exc!r}"
    else:
        if not torch.cuda.is_available() and not isinstance(tl.zeros, InterpretedFunction):
            problem = "no CUDA, and triton was imported before TRITON_INTERPRET=1 could be set"
    if problem is None:
        return
    if os.environ.get("TOKENPIPE_REQUIRE_TRITON") == "1":
        pytest.fail(f"TOKENPIPE_REQUIRE_TRITON=1: {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def default_model_gguf() -> Path:
    """The default GGUF. Under TOKENPIPE_NO_DEFAULT_MODEL=1 (tools/device_env.sh sets it on a
    lent GPU, which cannot carry the 253 MB package) a test that needs it is skipped."""
    from worker.loading.default_model import default_model_path

    if os.environ.get("TOKENPIPE_NO_DEFAULT_MODEL") == "1":
        pytest.skip("TOKENPIPE_NO_DEFAULT_MODEL=1: the default model's package is not installed")
    return default_model_path()


@pytest.fixture(scope="session")
def default_model_dir(default_model_gguf: Path) -> Path:
    """The converted (float32) cache directory of the default model."""
    from worker.loading.gguf_convert import convert_gguf

    return convert_gguf(default_model_gguf, torch.float32, progress=False)


from tiny_models import byte_level_tokenizer_json, llama_tensor_shapes, tiny_config  # noqa: E402,F401

_EXIT_STATUS: list[int] = []  # the session's, for pytest_unconfigure


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave at once with the session's exit status, once pytest has reported (the summary and
    the junit file are written by now), skipping the interpreter's teardown. In one of four
    local CI runs (session 50) that teardown segfaulted after 1,912 tests had passed, with no
    trace. By then 87 threads were alive (Ray's router loop, the session readers and writers of
    engines that tests did not close); torch's teardown crashing with threads about is a known
    class. `_close_session_stores` now closes those stores after each test: two threads are left
    at exit (Ray's router loop, tqdm's monitor), and the guard stays for them. It is no part of
    the product: the worker and supervisor processes the tests start exit normally, and tests
    assert their exit codes. The threads still alive are counted on stderr first.
    TOKENPIPE_TEST_TEARDOWN=1 keeps the teardown (to hunt the crash)."""
    import re
    import threading
    from collections import Counter

    alive = Counter(
        re.sub(r"_\d+", "_N", t.name) + (" (daemon)" if t.daemon else "")
        for t in threading.enumerate()
        if t is not threading.main_thread()
    )
    if alive:
        names = ", ".join(f"{name} x{n}" for name, n in sorted(alive.items()))
        print(f"threads alive at exit: {names}", file=sys.stderr)
    if _EXIT_STATUS and os.environ.get("TOKENPIPE_TEST_TEARDOWN") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


@pytest.fixture(autouse=True)
def _close_session_stores(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Close, after each test, every SessionStore it opened and left open (an Engine made with
    a session_dir and never closed): its writer, spill and reader threads end with the test,
    not at the interpreter's exit (session 50 counted 87 threads alive there)."""
    from worker.engine.session_store import SessionStore

    opened: list[SessionStore] = []
    init = SessionStore.__init__

    def tracked(self: SessionStore, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(SessionStore, "__init__", tracked)
    yield
    for store in opened:
        if not store._closing:
            store.close()


TinyFactory = Callable[..., Path]


@pytest.fixture
def tiny_checkpoint_factory(tmp_path: Path) -> TinyFactory:
    """make(name="ckpt", dtype=torch.float32, shards=1, config_overrides={}, weights=True,
    generation_config={...} | None, tokenizer_config={...} | None, prefix="") -> directory.

    Weights are seeded random values; `prefix` prepends a name prefix to every tensor (e.g.
    "model.language_model." after stripping "model." to mimic a multimodal checkpoint).
    """
    from safetensors.torch import save_file

    def make(
        name: str = "ckpt",
        dtype: torch.dtype = torch.float32,
        shards: int = 1,
        config_overrides: dict[str, Any] | None = None,
        weights: bool = True,
        generation_config: dict[str, Any] | None = None,
        tokenizer_config: dict[str, Any] | None = None,
        extra_tensors: dict[str, torch.Tensor] | None = None,
        rename: Callable[[str], str] | None = None,
    ) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        tokenizer_json = byte_level_tokenizer_json()
        vocab_size = 256 + 4 + 3
        overrides = dict(config_overrides or {})
        config = tiny_config("llama", overrides.pop("vocab_size", vocab_size), **overrides)
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
        if generation_config is not None:
            (directory / "generation_config.json").write_text(json.dumps(generation_config))
        if tokenizer_config is not None:
            (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        if not weights:
            return directory
        generator = torch.Generator().manual_seed(0)
        tensors = {
            tensor_name: (torch.randn(shape, generator=generator) * 0.05).to(dtype)
            for tensor_name, shape in llama_tensor_shapes(config).items()
        }
        if rename is not None:
            tensors = {rename(k): v for k, v in tensors.items()}
        if extra_tensors:
            tensors.update(extra_tensors)
        names = list(tensors)
        if shards == 1:
            save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for index in range(shards):
                filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
                part = {k: tensors[k] for k in names[index::shards]}
                save_file(part, str(directory / filename), metadata={"format": "pt"})
                weight_map.update({k: filename for k in part})
            (directory / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map})
            )
        return directory

    return make


# ---------------------------------------------------------------------------------------------
# The transformers oracle for the default GGUF


class HFGGUFOracle:
    """transformers' reading of a GGUF: its config object and fp32 dequantized state dict."""

    def __init__(self, gguf_path: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        torch.set_num_threads(2)
        self.config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        # The same call `from_pretrained(gguf_file=...)` makes for this architecture (it needs
        # `accelerate` only to place the model, which these tests do themselves).
        parsed = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
        )
        self.state_dict: dict[str, torch.Tensor] = parsed["tensors"]
        self._model: Any = None

    def model(self) -> Any:
        """The transformers model with the dequantized weights (built on first use)."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
            missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
            model.tie_weights()
            assert not unexpected, unexpected
            assert set(missing) <= {"lm_head.weight"}, missing
            self._model = model.eval()
        return self._model


@pytest.fixture(scope="session")
def hf_gguf_oracle(default_model_gguf: Path) -> HFGGUFOracle:
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return HFGGUFOracle(default_model_gguf)
