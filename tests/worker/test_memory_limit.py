"""``--gpu-memory-gb`` (worker/device/memory.py): the allocator's cap, what the sizing sees
under it, the out-of-memory message, and the flag through `serve`, `ray up` and a worker
process. The CUDA calls are faked here; BENCHMARKS.md has the run on an H200 held to 24 GiB."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from click.testing import CliRunner

from worker.device import memory

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
TOKENPIPE = (
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'tokenpipe'; from supervisor.cli import main; main()",
)


class FakeCuda:
    """torch.cuda's memory calls on one 141 GiB card: `held` GiB by others and the context."""

    def __init__(self, card: float = 141, held: float = 0.5, reserved: float = 0) -> None:
        self.card, self.held, self.reserved = int(card * GIB), int(held * GIB), int(reserved * GIB)
        self.fractions: list[tuple[float, str]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (self.free, self.card))
        monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: self.reserved)
        monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: self.reserved // 2)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda d=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: self.reserved // 2)
        monkeypatch.setattr(
            cuda, "set_per_process_memory_fraction", lambda f, d=None: self.fractions.append((f, d))
        )
        monkeypatch.setattr(memory, "_LIMITS", {})
        return self

    @property
    def free(self) -> int:
        return self.card - self.held - self.reserved


def test_limit_takes_what_is_held_outside_torch_off_the_top(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = FakeCuda(held=0.5).install(monkeypatch)
    lines: list[str] = []
    limit = memory.apply("cuda", 24, lines.append)
    assert limit is not None and limit.total == 24 * GIB and limit.outside == GIB // 2
    ((fraction, device),) = cuda.fractions
    assert device == "cuda:0" and fraction * cuda.card == pytest.approx(23.5 * GIB)
    assert "24 GiB" in lines[0] and "0.50 GiB held outside" in lines[0]
    assert memory.limit_for("cuda:0") == limit

    # what the sizing sees: the limit's room, not the card's 140 GiB free
    assert memory.free_bytes("cuda:0") == 23.5 * GIB
    cuda.reserved = 20 * GIB
    assert memory.free_bytes("cuda:0") == 3.5 * GIB
    cuda.reserved = 30 * GIB  # past it (cannot happen under the real cap): nothing, not < 0
    assert memory.free_bytes("cuda:0") == 0
    figures = memory.figures("cuda:0")
    assert figures["device_memory_limit"] == 24 * GIB
    assert figures["device_memory_used"] == 30.5 * GIB
    assert figures["device_memory_peak_reserved"] == 30 * GIB
    assert memory.summary("cuda:0") == (
        "15.00 GiB allocated, 30.00 reserved (peak 30.00), 0.50 outside torch, of 24.0"
    )  # fmt: skip


def test_graph_pools_are_counted_apart() -> None:
    """The private pools' segments (CUDA graphs) from a memory snapshot: reserved and
    allocated; the default pool's (id (0, 0)) are not theirs."""
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 8 * GIB, "allocated_size": 7 * GIB},
        {"segment_pool_id": (1, 2), "total_size": 300 << 20, "allocated_size": 100 << 20},
        {"segment_pool_id": (1, 3), "total_size": 100 << 20, "allocated_size": 0},
        {"total_size": GIB, "allocated_size": GIB},  # no id: the default pool
    ]
    assert memory.graph_pools(segments) == (400 << 20, 100 << 20)
    assert memory.graph_pools([]) == (0, 0)


def test_the_graph_pools_line_never_stops_a_start(monkeypatch: pytest.MonkeyPatch) -> None:
    other = {"device": 1, "segment_pool_id": (1, 1), "total_size": GIB, "allocated_size": 0}
    mine = {"device": 0, "segment_pool_id": (1, 2), "total_size": GIB // 2, "allocated_size": 0}
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [other, mine])
    assert memory.graph_pools_summary("cuda:0") == "0.50 GiB in CUDA graph pools (0.00 allocated)"

    def broken() -> list[dict[str, int]]:
        raise RuntimeError("no snapshot")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", broken)
    assert memory.graph_pools_summary("cuda:0") == "CUDA graph pools not measured (no snapshot)"


def test_a_context_that_grew_past_the_limit_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap cannot see what CUDA takes outside the allocator after it is set (H100: 0.51 ->
    0.79 GiB by the end of start-up); the worker says so at ready instead of staying quiet."""
    cuda = FakeCuda(held=0.5).install(monkeypatch)
    memory.apply("cuda", 24, None)
    cuda.reserved = 23 * GIB
    assert memory.over_limit("cuda:0") is None  # 23.5 of 24
    cuda.held = int(0.8 * GIB)
    assert memory.over_limit("cuda:0") is None  # 23.8
    cuda.reserved = int(23.4 * GIB)
    warning = memory.over_limit("cuda:0")
    assert warning is not None and "24.20 GiB, 0.20 over --gpu-memory-gb 24" in warning
    assert "from 0.50 to 0.80 GiB" in warning
    monkeypatch.setattr(memory, "_LIMITS", {})
    assert memory.over_limit("cuda:0") is None  # no limit: nothing to be over


def test_cuda_workers_grow_allocator_segments_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Expandable segments (fixed ones held 5 GiB of gaps packing an int4 31B GGUF under 23.5
    GiB): set in the environment before CUDA starts, told to the allocator after; a user's
    PYTORCH_CUDA_ALLOC_CONF stands."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert memory.prefer_expandable_segments() is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"

    told: list[str] = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)
    assert memory.prefer_expandable_segments() is True and told == ["expandable_segments:True"]

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert memory.prefer_expandable_segments() is False
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert told == ["expandable_segments:True"]


def test_no_limit_when_the_card_is_no_bigger(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(card=23.6).install(monkeypatch)
    lines: list[str] = []
    assert memory.apply("cuda:0", 24, lines.append) is None
    assert cuda.fractions == [] and "no limit" in lines[0]
    assert memory.free_bytes("cuda:0") == cuda.free  # the card's own free memory
    assert memory.figures("cuda:0")["device_memory_limit"] == cuda.card


def test_bad_limits_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(held=2).install(monkeypatch)
    with pytest.raises(ValueError, match=r"already hold 2\.00 GiB of cuda:0"):
        memory.apply("cuda", 1.5)
    with pytest.raises(ValueError, match="needs a CUDA device, not cpu"):
        memory.apply("cpu", 24)
    with pytest.raises(ValueError, match="above 0"):
        memory.apply("cuda", 0)
    assert cuda.fractions == [] and memory.limit_for("cuda:0") is None


def test_out_of_memory_names_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda().install(monkeypatch)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    plain = memory.explain_out_of_memory(oom, "cuda:0", "loading the weights")
    assert isinstance(plain, MemoryError)
    assert (
        "while loading the weights (141.0 GiB on cuda:0; 0.00 GiB allocated, "
        "tried to allocate 2.00 GiB)" in str(plain)
    )
    memory.apply("cuda:0", 24)
    limited = memory.explain_out_of_memory(oom, "cuda:0", "building the KV cache")
    assert "the --gpu-memory-gb limit of 24.0 GiB on cuda:0" in str(limited)
    assert "tokenpipe info" in str(limited) and "--max-context" in str(limited)
    assert "try --quantize int4, fewer --max-sessions" in str(limited)
    already = memory.explain_out_of_memory(oom, "cuda:0", "packing the weights", "int4")
    assert "try fewer --max-sessions or a shorter --max-context" in str(already)
    other = ValueError("not memory")
    assert memory.explain_out_of_memory(other, "cuda:0", "loading") is other
    assert memory.explain_out_of_memory(oom, "cpu", "loading") is oom


def test_default_context_is_sized_within_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.main import _default_prefix_cache_gb, _memory_capped_context

    class Model:  # 1 MiB of KV a token, no sliding rings, parameters on "cuda"
        def parameters(self) -> Any:
            yield torch.empty(0, device="meta").as_subclass(torch.Tensor)

        def make_kv_cache(self, slots: int, context: int, device: Any = None) -> Any:
            return type("KV", (), {"bytes_per_slot": context << 20})()

    cuda = FakeCuda(card=141, held=0.5, reserved=18.5).install(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda:0")))
    free_card = _memory_capped_context(Model(), 2, 32768)
    assert free_card == 32768  # 122 GiB free: the full context
    memory.apply("cuda:0", 24)  # 24 - 0.5 - 18.5 = 5 GiB left, 80% of it for 2 sessions
    assert _memory_capped_context(Model(), 2, 32768) == 2048
    # the cap's line names --quantize int4 where the weights are not int4 already
    from worker import main as worker_main

    lines: list[str] = []
    monkeypatch.setattr(worker_main, "log", lines.append)
    assert _memory_capped_context(Model(), 2, 32768, quantize="auto") == 2048
    assert _memory_capped_context(Model(), 2, 32768, quantize="int4") == 2048
    assert "capped at 2048 tokens" in lines[0] and "--quantize int4 leaves more room" in lines[0]
    assert "--quantize" not in lines[1]
    assert all(line.endswith("; --kv-cache-dtype fp8 holds twice the tokens") for line in lines)
    fp8 = Model()
    fp8.kv_cache_dtype = torch.float8_e4m3fn  # type: ignore[attr-defined]
    assert _memory_capped_context(fp8, 2, 32768, quantize="int4") == 2048
    assert "fp8" not in lines[2]
    assert _default_prefix_cache_gb(torch.device("cuda:0")) == pytest.approx(0.15 * 5)
    # --max-context given: the sessions' KV first, the prefix cache from what it leaves
    assert _default_prefix_cache_gb(torch.device("cuda:0"), 4 * GIB) == pytest.approx(0.15)
    assert _default_prefix_cache_gb(torch.device("cuda:0"), 6 * GIB) == 0
    assert cuda.fractions


def test_serve_and_ray_pass_the_flags_to_their_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor.openai import cli
    from worker.loading.quantize import MODES

    assert cli.QUANTIZE_MODES == MODES  # the front ends offer what the worker takes
    assert cli.weights_args("int4", 64, 23.5) == (
        "--quantize", "int4", "--group-size", "64", "--gpu-memory-gb", "23.5",
    )  # fmt: skip
    assert cli.weights_args(None, None, None) == ()
    assert cli.weights_args(None, None, None, "fp8") == ("--kv-cache-dtype", "fp8")
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def capture(**kwargs: Any) -> Any:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr("supervisor.core.SupervisorConfig", capture)
    result = CliRunner().invoke(
        cli.command,
        ["--quantize", "int4", "--gpu-memory-gb", "24", "--max-resident", "2"]
        + ["--kv-cache-dtype", "fp8"],
    )
    assert isinstance(result.exception, Stop), result.output
    assert seen["worker_args"] == (
        "--max-resident",
        "2",
        "--quantize",
        "int4",
        "--gpu-memory-gb",
        "24.0",
        "--kv-cache-dtype",
        "fp8",
    )
    bad = CliRunner().invoke(cli.command, ["--quantize", "int3"])
    assert bad.exit_code == 2 and "int3" in bad.output


def test_worker_on_the_cpu_refuses_the_flag_before_loading() -> None:
    result = subprocess.run(
        [*TOKENPIPE, "worker", "--device", "cpu", "--gpu-memory-gb", "8"],
        input=b"",
        capture_output=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 1
    (line,) = [orjson.loads(x) for x in result.stdout.splitlines() if x.strip()]
    assert line["event"] == "error" and "needs a CUDA device" in line["error"]
    assert "loading" not in result.stderr.decode()  # refused before the model


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_worker_asked_for_cuda_without_it_says_so_before_loading() -> None:
    result = subprocess.run(
        [*TOKENPIPE, "worker", "--device", "cuda", "--gpu-memory-gb", "8"],
        input=b"",
        capture_output=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 1
    (line,) = [orjson.loads(x) for x in result.stdout.splitlines() if x.strip()]
    assert line["event"] == "error" and line["error"].startswith("failed to start: --device cuda")
    assert "has no CUDA" in line["error"] or "CUDA device(s) visible" in line["error"]
    assert "loading" not in result.stderr.decode()


def test_quantized_experts_prefill_without_a_scratch_that_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer's hit experts dequantize into a float scratch for a prefill chunk (1.5 GiB for
    the 35B-A3B model): where twice that does not fit beside the caches the worker is about to
    allocate, prefill takes the quantized grouped GEMMs (no scratch) instead."""
    from worker import main as worker_main
    from worker.layers import quant_experts
    from worker.layers.quant import QuantFormat

    monkeypatch.setitem(quant_experts.DEQUANT_SCRATCH, "allowed", True)
    model = torch.nn.Sequential(quant_experts.QuantExperts(4, 64, 32, QuantFormat("int4", 32)))
    scratch = 4 * (64 * 64 + 64 * 32) * 2  # gate_up [4, 64, 64] and down [4, 64, 32] in bf16
    assert quant_experts.dequant_scratch_bytes(model, torch.bfloat16) == scratch
    assert quant_experts.dequant_scratch_bytes(torch.nn.Linear(2, 2), torch.bfloat16) == 0
    room = {"free": 1000 + 2 * scratch}
    monkeypatch.setattr(memory, "free_bytes", lambda device: room["free"])
    assert worker_main._fit_expert_scratch(model, torch.bfloat16, "cuda:0", caches=1000)
    assert quant_experts.DEQUANT_SCRATCH["allowed"] is True
    room["free"] -= 1
    assert not worker_main._fit_expert_scratch(model, torch.bfloat16, "cuda:0", caches=1000)
    assert quant_experts.DEQUANT_SCRATCH["allowed"] is False
    # a model without quantized experts never needs one
    assert worker_main._fit_expert_scratch(torch.nn.Linear(2, 2), torch.bfloat16, "cuda:0", 1000)
    assert quant_experts.DEQUANT_SCRATCH["allowed"] is True


# ---------------------------------------------------------------------------------------------
# A prefill step's activations: the estimate, the worker's chunk fit, and `info`'s device_estimate


def _example_config(name: str) -> dict[str, Any]:
    import json

    return json.loads((REPO / "examples" / name / "config.json").read_text())


def test_prefill_step_estimate_covers_the_measured_peaks() -> None:
    """Peak allocated over the steady state, one step per prompt length, prefix cache off (H100,
    session 31): the estimate is at least what was measured and at most 25% above it."""
    measured = {  # (config, chunk): GiB
        ("gemma4_31b", 1024): 0.239,
        ("gemma4_31b", 2048): 0.416,
        ("qwen3_5_moe", 512): 0.181,
        ("qwen3_5_moe", 1024): 0.354,
        ("qwen3_5_moe", 2048): 0.698,
    }
    for (name, chunk), gib in measured.items():
        estimate = memory.prefill_step_bytes(_example_config(name), chunk, torch.bfloat16) / GIB
        assert gib <= estimate <= 1.25 * gib + 0.07, (name, chunk, estimate)
    # fla's kernels for the DeltaNet prefill (fla-core 0.6 carried to the H100, session 32)
    for chunk, gib in {512: 0.082, 1024: 0.163, 2048: 0.324}.items():
        estimate = memory.prefill_step_bytes(
            _example_config("qwen3_5_moe"), chunk, torch.bfloat16, fla=True
        )
        assert gib <= estimate / GIB <= 1.25 * gib + 0.07, (chunk, estimate / GIB)
    # the prefix cache on: a hybrid step also keeps each DeltaNet layer's state at block ends
    qwen = _example_config("qwen3_5_moe")
    off = memory.prefill_step_bytes(qwen, 1024, torch.bfloat16)
    on = memory.prefill_step_bytes(qwen, 1024, torch.bfloat16, state_every=256)
    assert on - off == 4 * 30 * 32 * 128 * 128 * 4  # 4 block ends x 30 DeltaNet layers
    implied = {k: v for k, v in qwen.items() if k != "layer_types"}  # every 4th layer full
    assert memory.prefill_step_bytes(implied, 1024, torch.bfloat16, 256) == on
    gemma = _example_config("gemma4_31b")
    assert memory.prefill_step_bytes(gemma, 2048, torch.bfloat16, 256) == (
        memory.prefill_step_bytes(gemma, 2048, torch.bfloat16)
    )
    # fp32 doubles the float activations (a CPU-sized model's dtype)
    assert memory.prefill_step_bytes(gemma, 2048, torch.float32) > 1.9 * (
        memory.prefill_step_bytes(gemma, 2048, torch.bfloat16) - memory.PREFILL_SCRATCH_BYTES
    )


def test_unallocated_counts_the_allocators_cached_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(card=141, held=0.5, reserved=18).install(monkeypatch)  # 9 GiB of it allocated
    assert memory.unallocated_bytes("cuda:0") == int((141 - 0.5 - 9) * GIB)
    memory.apply("cuda:0", 24)  # the allocator may hold 23.5 GiB
    assert memory.unallocated_bytes("cuda:0") == int((23.5 - 9) * GIB)
    assert memory.free_bytes("cuda:0") == int((23.5 - 18) * GIB)


def test_the_default_prefill_chunk_shrinks_until_a_step_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen3.5 35B-A3B's Q4_K_M file with two 16k slots under 23.5 GiB started with a 2,048-token
    chunk and then ran out on its first 16k prompt (session 31); the fitted chunk served it."""
    from worker import main as worker_main
    from worker.engine.engine import EngineConfig

    qwen = _example_config("qwen3_5_moe")
    lines: list[str] = []
    monkeypatch.setattr(worker_main, "log", lines.append)
    room = {"bytes": 0}
    monkeypatch.setattr(memory, "unallocated_bytes", lambda device: room["bytes"])
    config = EngineConfig(max_sessions=2, max_context=16384, prefill_chunk=2048,
                          prefix_cache_bytes=GIB // 8)  # fmt: skip
    margin = memory.GRAPHS_BYTES + memory.FRAGMENTATION_BYTES
    caches = GIB

    def fit(chosen: bool = False) -> int:
        return worker_main._fit_prefill_chunk(
            qwen, config, torch.bfloat16, "cuda:0", caches, chosen
        )

    need = memory.prefill_step_bytes(qwen, 2048, torch.bfloat16, 256)
    room["bytes"] = caches + margin + need
    assert fit() == 2048 and not lines  # room enough: nothing said
    room["bytes"] -= 1
    assert fit() == 1024 and "prefill chunk 1024: a 2048-token step needs" in lines[-1]
    # a scratch reserved before the fit is out of the room already, and in the step's need
    scratch = memory.PREFILL_SCRATCH_BYTES
    room["bytes"] = caches + margin + need - scratch
    assert fit() == 1024
    assert (
        worker_main._fit_prefill_chunk(
            qwen, config, torch.bfloat16, "cuda:0", caches, False, scratch=scratch
        )
        == 2048
    )
    room["bytes"] = caches + margin + int(0.52 * GIB)  # the H100 run's room: 512 served 16k
    assert fit() == 512
    monkeypatch.setattr(worker_main, "_fla_prefill", lambda *args: True)
    assert fit() == 1024  # fla's step is half the torch form's (with the prefix states)
    monkeypatch.setattr(worker_main, "_fla_prefill", lambda *args: False)
    room["bytes"] = 0
    assert fit() == memory.MIN_PREFILL_CHUNK  # never below the floor
    lines.clear()
    assert fit(chosen=True) == 2048 and lines[-1].startswith("warning: a --prefill-chunk 2048")
    # the prefix cache off: no states at block ends, a smaller step
    bare = EngineConfig(max_sessions=2, max_context=16384, prefill_chunk=2048)
    room["bytes"] = caches + margin + memory.prefill_step_bytes(qwen, 2048, torch.bfloat16)
    assert (
        worker_main._fit_prefill_chunk(qwen, bare, torch.bfloat16, "cuda:0", caches, False) == 2048
    )
    # the same room without the prefix states: 1,024 with the torch form, 2,048 with fla
    room["bytes"] = caches + margin + int(0.52 * GIB)
    for fla, chunk in ((False, 1024), (True, 2048)):
        monkeypatch.setattr(worker_main, "_fla_prefill", lambda *args, on=fla: on)
        assert (
            worker_main._fit_prefill_chunk(qwen, bare, torch.bfloat16, "cuda:0", caches, False)
            == chunk
        )


def test_quantized_weights_take_a_longer_default_chunk_where_it_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill step dequantizes every quantized dense matmul once a chunk; 4,096-token chunks
    took a 16k prompt 6.4% faster on int4 weights (session 46). The longer chunk is only
    preferred: where its step does not fit, the 2,048 default's fit runs as before (in silence
    where 2,048 fits), and a chunk the user chose is kept."""
    from worker import main as worker_main
    from worker.engine.engine import EngineConfig

    gemma = _example_config("gemma4_31b")
    lines: list[str] = []
    monkeypatch.setattr(worker_main, "log", lines.append)
    monkeypatch.setattr(worker_main, "_fla_prefill", lambda *args: False)
    room = {"bytes": 0, "holes": 0}
    monkeypatch.setattr(memory, "unallocated_bytes", lambda device: room["bytes"])
    monkeypatch.setattr(memory, "holes_bytes", lambda device: room["holes"])
    config = EngineConfig(max_sessions=2, max_context=8192, prefill_chunk=2048)
    margin = memory.GRAPHS_BYTES + memory.FRAGMENTATION_BYTES
    caches = 4 * GIB
    preferred = memory.QUANTIZED_PREFILL_CHUNK

    def fit(chosen: bool = False, prefer: int = preferred) -> int:
        return worker_main._fit_prefill_chunk(
            gemma, config, torch.bfloat16, "cuda:0", caches, chosen, preferred=prefer
        )

    def step(chunk: int) -> int:
        return memory.prefill_step_bytes(gemma, chunk, torch.bfloat16)

    room["bytes"] = caches + margin + step(preferred)
    said = f"prefill chunk {preferred}: quantized weights, which a prefill step dequantizes"
    assert fit() == preferred and lines == [said + " once a chunk"]
    lines.clear()
    assert fit(prefer=0) == 2048 and not lines  # float weights: the 2,048 default
    assert fit(chosen=True) == 2048 and not lines  # the user's chunk, which fits
    short = EngineConfig(max_sessions=2, max_context=2048, prefill_chunk=2048)
    assert (
        worker_main._fit_prefill_chunk(
            gemma, short, torch.bfloat16, "cuda:0", caches, False, preferred=preferred
        )
        == 2048
    )  # no prompt of a 2,048-token context needs a longer chunk
    assert not lines
    room["holes"] = 1  # the load's holes do not count for the longer chunk (session 47: its
    assert fit() == 2048 and not lines  # warm-up ran out on a 24 GB card's limit)
    room["holes"] = 0
    room["bytes"] -= 1  # 4,096 does not fit, 2,048 does: the old default, nothing said
    assert fit() == 2048 and not lines
    room["holes"] = step(preferred)  # nor do they for the default: it fits as before
    assert fit() == 2048 and not lines
    room["bytes"] = caches + margin + step(2048) - 1  # nor 2,048: halved, as before
    assert fit() == 1024 and lines[-1].startswith("prefill chunk 1024: a 2048-token step needs")


def test_which_models_prefill_dequantizes_a_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quantized dense matmuls besides the LM head, or quantized experts whose float scratch
    is allowed: yes; a quantized head alone, float weights, or experts left to the grouped
    GEMMs on their codes (no room for the scratch): no."""
    from torch import nn

    from worker import main as worker_main
    from worker.layers import quant_experts
    from worker.layers.quant import INT4, INT8, QuantFormat, QuantLinear
    from worker.layers.quant_experts import QuantExperts

    def model(*layers: nn.Module, head: nn.Module | None = None) -> nn.Module:
        m = nn.Module()
        m.layers = nn.ModuleList(layers)
        m.lm_head = head
        return m

    int4, int8 = QuantFormat(INT4, 32), QuantFormat(INT8, 32)
    head = QuantLinear(64, 128, int8)
    assert worker_main._dequantizes_per_chunk(model(QuantLinear(64, 64, int4), head=head))
    assert not worker_main._dequantizes_per_chunk(model(nn.Linear(64, 64), head=head))
    assert not worker_main._dequantizes_per_chunk(model(nn.Linear(64, 64)))
    experts = QuantExperts(4, 64, 32, int4)
    monkeypatch.setitem(quant_experts.DEQUANT_SCRATCH, "allowed", True)
    assert worker_main._dequantizes_per_chunk(model(nn.Linear(64, 64), experts, head=head))
    assert worker_main._dequantizes_per_chunk(model(QuantLinear(64, 64, int8), experts))
    monkeypatch.setitem(quant_experts.DEQUANT_SCRATCH, "allowed", False)
    assert not worker_main._dequantizes_per_chunk(model(nn.Linear(64, 64), experts, head=head))


def test_a_warm_up_out_of_memory_halves_the_default_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 37: Gemma 4 31B Q4_K_M kept with two 8k slots under 23.5 GiB passed the fit at
    2,048 and its warm-up ran 64 MiB short; the first long prompt then failed the same way.
    The warm-up now halves the default chunk until a step runs; other errors, and a chunk the
    user chose, stay warnings."""
    from worker import main as worker_main

    lines: list[str] = []
    monkeypatch.setattr(worker_main, "log", lines.append)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    class Engine:
        def __init__(self, chunk: int, fits: int, error: str = "CUDA out of memory") -> None:
            self.prefill_chunk, self.fits, self.error, self.runs = chunk, fits, error, 0

        def warm_up_prefill(self) -> int:
            self.runs += 1
            if self.prefill_chunk > self.fits:
                raise RuntimeError(f"the prefill warm-up failed: step failed: {self.error}")
            return self.prefill_chunk

    engine = Engine(2048, fits=512)
    worker_main._warm_up(engine, chosen=False)
    assert engine.prefill_chunk == 512 and engine.runs == 3
    assert lines == ["prefill chunk 1024: the warm-up ran out of device memory at 2048 tokens a "
                     "step", "prefill chunk 512: the warm-up ran out of device memory at 1024 "
                     "tokens a step"]  # fmt: skip
    lines.clear()  # torch's message names the allocation that failed: the line says it
    torch_says = "CUDA out of memory. Tried to allocate 26.00 MiB. GPU 0 has a total capacity"
    worker_main._warm_up(Engine(2048, fits=1024, error=torch_says), chosen=False)
    assert lines == ["prefill chunk 1024: the warm-up ran out of device memory at 2048 tokens a "
                     "step (a 26.00 MiB allocation failed)"]  # fmt: skip
    lines.clear()
    engine = Engine(2048, fits=0)  # never below the floor
    worker_main._warm_up(engine, chosen=False)
    assert engine.prefill_chunk == memory.MIN_PREFILL_CHUNK and lines[-1].startswith("warning:")
    for engine, chosen in ((Engine(2048, 512), True), (Engine(2048, 512, "bad shape"), False)):
        worker_main._warm_up(engine, chosen=chosen)
        assert engine.prefill_chunk == 2048 and engine.runs == 1
        assert lines[-1].startswith("warning: the prefill warm-up failed")


def test_fla_prefill_only_for_a_hybrid_model_on_cuda_in_half_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker import main as worker_main
    from worker.layers import deltanet

    monkeypatch.setattr(deltanet, "fla_chunk_rule", lambda: object())
    qwen, gemma = _example_config("qwen3_5_moe"), _example_config("gemma4_31b")
    assert worker_main._fla_prefill(qwen, "cuda:0", torch.bfloat16)
    assert worker_main._fla_prefill({"text_config": qwen}, "cuda:0", torch.float16)
    assert not worker_main._fla_prefill(qwen, "cuda:0", torch.float32)  # the torch form
    assert not worker_main._fla_prefill(qwen, "cpu", torch.bfloat16)
    assert not worker_main._fla_prefill(gemma, "cuda:0", torch.bfloat16)
    monkeypatch.setattr(deltanet, "fla_chunk_rule", lambda: None)  # not installed
    # info's question, without importing fla: the switch turns it off whatever is installed
    monkeypatch.setenv("TOKENPIPE_NO_FLA", "1")
    assert not deltanet.fla_installed()
    assert not worker_main._fla_prefill(qwen, "cuda:0", torch.bfloat16)  # (not installed)


def test_info_device_estimate_against_the_24_gb_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tokenpipe info --gpu-memory-gb 23.5` on the example configs (int4 of a bf16 checkpoint)
    agrees with the runs under that limit (BENCHMARKS.md, sessions 27-31): Gemma 4 31B with two
    8,192-token slots fits (23.6-23.8 GiB on the card at its peak), three do not."""
    import json

    from tiny_models import byte_level_tokenizer_json

    from worker import info
    from worker.info import command

    monkeypatch.setattr(info, "_fla_installed", lambda dtype: False)  # the torch form first

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps(byte_level_tokenizer_json()))

    def estimate(name: str, *flags: str) -> dict[str, Any]:
        args = ["--model", str(REPO / "examples" / name), "--tokenizer-path", str(tokenizer),
                "--quantize", "int4", "--dtype", "bfloat16", "--gpu-memory-gb", "23.5",
                *flags]  # fmt: skip
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["device_estimate"]

    two = estimate("gemma4_31b", "--context", "8192")
    assert two["slots"] == 2 and two["fits"] and two["max_slots_at_context"] == 2
    parts = ("weights_bytes", "sessions_bytes", "prefill_step_bytes", "runtime_bytes")
    assert two["total_bytes"] == sum(two[p] for p in parts)
    assert 22.4 * GIB < two["total_bytes"] < 23.5 * GIB
    assert 8192 < two["max_context_at_slots"] < 16384
    three = estimate("gemma4_31b", "--context", "8192", "--max-sessions", "3")
    assert three["slots"] == 3 and not three["fits"]
    resident = estimate("gemma4_31b", "--context", "8192", "--max-sessions", "3",
                        "--max-resident", "2")  # fmt: skip
    assert resident["slots"] == 2 and resident["fits"]
    # Qwen3.5 35B-A3B in int4: the experts' float scratch is reported, not counted
    qwen = estimate("qwen3_5_moe", "--context", "16384")
    assert qwen["expert_scratch_bytes"] == (256 * 3 * 512 * 2048 * 2)
    # two 16k slots: not at a 2,048-token chunk; the default prefix pool would hold nothing, so
    # it is off (as the worker leaves it, session 32) and no states are kept: 1,024 fits
    assert qwen["prefix_pool_bytes"] == 0 and two["prefix_pool_bytes"] == 0
    assert not qwen["fits"] and qwen["fits_with_prefill_chunk"] == 1024
    assert qwen["deltanet_prefill"] == "torch" and "deltanet_prefill" not in two
    monkeypatch.setattr(info, "_fla_installed", lambda dtype: True)
    fla = estimate("qwen3_5_moe", "--context", "16384")
    assert (
        fla["deltanet_prefill"] == "fla" and fla["prefill_step_bytes"] < qwen["prefill_step_bytes"]
    )
    assert fla["fits_with_prefill_chunk"] == 2048
    # a bigger card: a pool that holds something, and the states it keeps (the last flag wins)
    roomy = estimate("qwen3_5_moe", "--context", "16384", "--gpu-memory-gb", "40")
    assert roomy["prefix_pool_bytes"] > 0
    assert roomy["prefill_step_bytes"] > fla["prefill_step_bytes"]
    # without --dtype: the top-level figures a CPU worker's float32, device_estimate the CUDA
    # worker's bfloat16 (it used to count float32 caches and activations for the GPU)
    monkeypatch.setattr(info, "_fla_installed", lambda dtype: False)
    args = ["--model", str(REPO / "examples" / "gemma4_31b"), "--tokenizer-path", str(tokenizer),
            "--quantize", "int4", "--gpu-memory-gb", "23.5", "--context", "8192"]  # fmt: skip
    plain = json.loads(CliRunner().invoke(command, args).stdout)
    assert plain["dtype"] == "float32" and plain["device_estimate"] == {**two, "dtype": "bfloat16"}
    fp32 = json.loads(CliRunner().invoke(command, [*args, "--dtype", "float32"]).stdout)
    assert fp32["device_estimate"]["dtype"] == "float32"
    assert fp32["device_estimate"]["total_bytes"] > two["total_bytes"]
    # int4 weights: the worker's longer default chunk where its step fits beside the two slots
    # and the load's holes (as the worker takes it): not under 23.5 (session 47: its warm-up
    # ran out there), on a 25 GB card; a chunk the user names is the one reported
    assert two["fits_with_prefill_chunk"] == 2048 and three["fits_with_prefill_chunk"] is None
    wider = estimate("gemma4_31b", "--context", "8192", "--gpu-memory-gb", "25")
    assert wider["fits_with_prefill_chunk"] == 4096
    named = estimate("gemma4_31b", "--context", "8192", "--gpu-memory-gb", "25",
                     "--prefill-chunk", "2048")  # fmt: skip
    assert named["fits_with_prefill_chunk"] == 2048
    assert {k: v for k, v in named.items() if k != "fits_with_prefill_chunk"} == {
        k: v for k, v in wider.items() if k != "fits_with_prefill_chunk"
    }
    assert roomy["fits_with_prefill_chunk"] == 4096  # int4 experts and dense matmuls
    # int4 experts alone take it only with room for twice their float scratch (else the
    # worker runs them on their codes, which dequantizes nothing a chunk)
    dense_too = estimate("qwen3_5_moe", "--context", "16384", "--gpu-memory-gb", "28")
    experts = estimate("qwen3_5_moe", "--context", "16384", "--gpu-memory-gb", "28",
                       "--quantize", "int4-experts")  # fmt: skip
    assert dense_too["fits_with_prefill_chunk"] == 4096
    assert experts["fits"] and experts["fits_with_prefill_chunk"] == 2048
    assert estimate("qwen3_5_moe", "--context", "16384", "--gpu-memory-gb", "29",
                    "--quantize", "int4-experts")["fits_with_prefill_chunk"] == 4096  # fmt: skip
    assert "expert_scratch_bytes" not in two
    # where the flags' weights do not fit, what --quantize int4 would (session 36); int4 itself
    # or a fit says nothing more
    assert "with_quantize_int4" not in two and "with_quantize_int4" not in three
    int8 = CliRunner().invoke(command, [*args, "--quantize", "int8", "--dtype", "bfloat16"])
    assert int8.exit_code == 0, int8.output
    over = json.loads(int8.stdout)["device_estimate"]
    assert not over["fits"] and over["weights_bytes"] > 23.5 * GIB
    assert over["with_quantize_int4"] == {key: two[key] for key in info.INT4_FIGURES}
    assert "does not fit --gpu-memory-gb 23.5" in int8.stderr
    assert "--quantize int4 would need 23.0" in int8.stderr and int8.stderr.endswith("fits\n")
    assert CliRunner().invoke(command, [*args, "--dtype", "bfloat16"]).stderr == ""
    assert "with_kv_cache_fp8" not in over  # the weights alone are over: no cache would fit
    # two 32k slots of int4: over with a bf16 cache, within with an fp8 one (session 38)
    long = CliRunner().invoke(command, [*args[:-1], "32768"])
    cut = json.loads(long.stdout)["device_estimate"]
    assert not cut["fits"] and cut["with_kv_cache_fp8"]["fits"]
    assert long.stderr.endswith("--kv-cache-dtype fp8 would need 23.47 GiB: fits\n"), long.stderr
    fp8 = json.loads(
        CliRunner().invoke(command, [*args[:-1], "32768", "--kv-cache-dtype", "fp8"]).stdout
    )
    assert {key: fp8["device_estimate"][key] for key in info.INT4_FIGURES} == cut[
        "with_kv_cache_fp8"
    ]
    assert (
        fp8["kv_cache_dtype"] == "float8_e4m3fn"
        and "with_kv_cache_fp8" not in fp8["device_estimate"]
    )
    bad = CliRunner().invoke(command, ["--model", str(REPO / "examples" / "gemma4_31b"),
                                       "--tokenizer-path", str(tokenizer), "--max-sessions", "2",
                                       "--max-resident", "3"])  # fmt: skip
    assert bad.exit_code == 1 and "--max-resident 3 is above --max-sessions 2" in bad.output


def test_the_quantized_scratch_is_reserved_before_the_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model with quantized matmuls gets its prefill scratch (``quant_matmul.SCRATCH_BYTES``)
    before its caches, while the memory is in one piece (session 40); a float model, or one
    whose only quantized matmul is its LM head, none; no room for it now leaves the steps to
    allocate their own, as before."""
    from torch import nn

    from worker import main as worker_main
    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    monkeypatch.setattr(qm, "_SCRATCH", {})
    assert worker_main._reserve_quant_scratch(nn.Sequential(nn.Linear(4, 4)), "cpu") == 0
    weight = Q.quantize(torch.randn(64, 64), Q.QuantFormat(Q.INT8, 32))
    head_only = nn.Sequential(nn.Linear(64, 64))
    head_only.lm_head = Q.QuantLinear.from_weight(weight)  # int4-experts' int8 head: last rows
    assert worker_main._reserve_quant_scratch(head_only, "cpu") == 0
    assert not qm._SCRATCH
    model = nn.Sequential(Q.QuantLinear.from_weight(weight))
    assert worker_main._reserve_quant_scratch(model, "cpu") == qm.SCRATCH_BYTES
    assert qm._SCRATCH[torch.device("cpu")].numel() == qm.SCRATCH_BYTES
    assert worker_main._reserve_quant_scratch(model, "cpu") == 0  # once a process

    def no_room(device: object) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(qm, "reserve_scratch", no_room)
    assert worker_main._reserve_quant_scratch(model, "cpu") == 0
