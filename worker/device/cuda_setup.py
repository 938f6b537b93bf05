"""Everything the CUDA path needs after a model is loaded, in one call.

    loaded.model = prepare_model_for_device(loaded, device, random_weights, seed)

On CUDA: merges each layer's q/k/v and gate/up weights (``CausalLM.fuse_projections``: one
GEMV/GEMM each, HF names gone afterwards: call it after the weights are in), and wraps the
model in ``GraphedCausalLM`` (decode steps replayed from CUDA graphs, with the fused Triton
norms / rotary / activation of ``worker.layers.blocks``). On any other device the model is
returned unchanged, so the CPU path stays bit-for-bit what it was.

Random weights are drawn by ``worker.loading.loader.load_model`` before this runs (on the GPU,
by ``worker.device.kernels.random_weights``).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch

from worker.device.compile_ahead import CompilePool, compile_ahead
from worker.loading.startup_clock import StartupClock

CPU_ONLY_FAMILIES: tuple[str, ...] = ()
"""Families whose layers have no CUDA path yet: refused here with a clear error (none now:
qwen3_5_moe has its DeltaNet / MoE kernels and decode graphs over its hybrid cache)."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare_model_for_device(
    loaded: Any,
    device: torch.device | str,
    random_weights: bool = False,
    seed: int = 0,
    *,
    cuda_graphs: bool = True,
    clock: StartupClock | None = None,
    compiles: CompilePool | None = None,
) -> Any:
    """-> the model object the Engine should use (``loaded.model`` itself off CUDA).

    ``random_weights`` and ``seed`` are accepted so the call site stays the same when an
    on-device step needs them; the current steps do not. TOKENPIPE_NO_FUSE=1 skips the merge,
    TOKENPIPE_NO_GRAPHS=1 (or ``cuda_graphs=False``) the CUDA graphs. Each step's time goes
    to stderr through `clock` (the worker's start-up clock, so the ready line can sum them).
    The graphs themselves are captured when the engine makes its KV cache
    (``GraphedCausalLM.make_kv_cache``), which the worker times as a step of its own.
    With `compiles`, each step's Triton kernel variants are compiled on that pool first
    (worker/device/compile_ahead.py).
    """
    del random_weights, seed
    model = loaded.model
    if torch.device(device).type != "cuda":
        return model
    from worker.device.graphed_lm import GraphedCausalLM

    clock = clock or StartupClock(_log)
    inner = model.inner if isinstance(model, GraphedCausalLM) else model
    family = getattr(getattr(inner, "config", None), "family", None)
    if family in CPU_ONLY_FAMILIES:
        raise ValueError(f"{family}: the CUDA path is not implemented yet; use --device cpu")
    from worker.device.kernels import prefer_small_dependents

    prefer_small_dependents(bool(getattr(inner, "small_kernel_dependents", True)))
    if os.environ.get("TOKENPIPE_NO_FUSE") != "1" and hasattr(inner, "fuse_projections"):
        with clock.step("cuda_setup: merged projections"):
            merged = inner.fuse_projections()
            torch.cuda.empty_cache()
        _log(f"cuda_setup: merged the projections of {merged} modules")
    with clock.step("cuda_setup: quantized weights packed"):
        packed, left = _pack_quantized(inner)
    if packed or left:
        _log(f"cuda_setup: {packed} quantized weights in the K-major layout of the W4A16/W8A16 "
             f"kernels, {left} left to the torch reference")  # fmt: skip
    if packed and not isinstance(model, GraphedCausalLM):  # no graph holds an address yet
        _compact_weights(inner, clock)
    if packed and os.environ.get("TOKENPIPE_NO_GEMV") != "1":
        with clock.step("cuda_setup: quantized kernel tiles timed"):
            shapes = _time_quantized(inner, compiles)
        _log(f"cuda_setup: quantized kernel tiles timed for {shapes} matrix shapes (the others "
             "remembered from an earlier start)")  # fmt: skip
    if os.environ.get("TOKENPIPE_NO_GEMV") != "1":
        with clock.step("cuda_setup: GEMV timing"):
            _install_gemv(inner, compiles)
    if isinstance(model, GraphedCausalLM):
        return model
    if cuda_graphs and os.environ.get("TOKENPIPE_NO_GRAPHS") != "1":
        return GraphedCausalLM(model, compiles=compiles)
    return model


def _pack_quantized(inner: Any) -> tuple[int, int]:
    """Quantized linears into the Triton kernels' layout (``worker.layers.quant``
    ``pack_for_device``); (0, 0) without quantized weights or without Triton."""
    from worker.device.kernels import triton_available
    from worker.layers.quant import INT6, QuantLinear, pack_for_device

    if not any(isinstance(m, QuantLinear) for m in inner.modules()):
        return 0, 0
    if not triton_available():
        raise ValueError("quantized weights on CUDA need Triton (pip install triton)")
    device = inner.model.norm.weight.device
    six_bit, why = six_bit_planes(device)
    if any(getattr(getattr(m, "format", None), "kind", None) == INT6 for m in inner.modules()):
        _log("cuda_setup: int6 weights (a GGUF's Q6_K) in " + (
            "6-bit planes (7 bits a weight)" if six_bit else
            "the int8 kernels' layout (9 bits a weight, faster decode batches)"
        ) + f": {why}")  # fmt: skip
    result = pack_for_device(inner, inner.model.norm.weight.dtype, six_bit, log=_log)
    torch.cuda.empty_cache()
    return result


def _compact_weights(inner: Any, clock: StartupClock) -> None:
    """The quantized model's weights moved end to end through the host where
    ``TOKENPIPE_COMPACT=1`` (``worker.device.compaction``): the load's holes back to the
    allocator in one piece. Off, a tight card's log says what it would return."""
    from worker.device import compaction

    device = inner.model.norm.weight.device
    wanted, why = compaction.wanted(device)
    if not wanted:
        if why:
            _log(f"cuda_setup: {why}")
        return
    with clock.step("cuda_setup: weights moved end to end"):
        done = compaction.compact(inner, device)
    if done is None:
        _log("cuda_setup: the weights stay where they loaded (the host lacks the room)")
        return
    mib = 1 << 20
    host = "page-locked" if done.pinned else "pageable"
    _log(f"cuda_setup: weights moved end to end through {host} host memory ("
         f"{done.moved_bytes / 1e9:.2f} GB in {done.storages} storages, {done.kept} left in "
         f"place, {done.seconds:.1f}s): "
         f"{done.holes_before / mib:.0f} MiB in holes before, {done.holes_after / mib:.0f} "
         "after")  # fmt: skip


SIX_BIT = "TOKENPIPE_INT6"
"""1: int6 weights always in 6-bit planes; 0: always in the int8 layout; unset: by memory
(``six_bit_planes``)."""


def six_bit_planes(device: Any) -> tuple[bool, str]:
    """Whether int6 weights (a GGUF's Q6_K) go into 6-bit planes on `device`, and why (for the
    start-up's log): where the weights loaded so far (int6 held as int8 bytes) take more than
    half the memory this worker may use (the free memory after them, under
    ``--gpu-memory-gb`` its limit's, is less than they take), so a 24-32 GB card fits a 31B
    Q4_K_M with room for its sessions. With room to spare the int8 kernels run them: as fast
    at one session, 1.2-1.6x faster on those matrices in decode batches of 8-32 (BENCHMARKS.md
    session 37), for 2 bits a weight more. ``TOKENPIPE_INT6`` =1 / =0 overrides."""
    setting = os.environ.get(SIX_BIT, "")
    if setting in ("0", "1"):
        return setting == "1", f"{SIX_BIT}={setting}"
    from worker.device import memory

    held, free = torch.cuda.memory_allocated(device), memory.unallocated_bytes(device)
    why = (f"{held / memory.GIB:.2f} GiB of weights, {free / memory.GIB:.2f} GiB free beside "
           f"them ({SIX_BIT}=1 / =0 to choose)")  # fmt: skip
    return free < held, why


def _time_quantized(inner: Any, compiles: CompilePool | None) -> int:
    from worker.device.kernels.quant_matmul import KMajorWeight, choose_configs, tiles_cache
    from worker.layers.quant import QuantLinear

    weights = {
        id(m.device_packed): m.device_packed
        for m in inner.modules()
        if isinstance(m, QuantLinear) and isinstance(m.device_packed, KMajorWeight)
    }
    dtype = inner.model.norm.weight.dtype
    device = inner.model.norm.weight.device
    choose = functools.partial(
        choose_configs, list(weights.values()), dtype, cache=tiles_cache(),
        device_name=torch.cuda.get_device_name(device),
    )  # fmt: skip
    # the candidates of the shapes not remembered, each launched once
    compile_ahead(compiles, [lambda: choose(timer=_launch_once, remember=False)], "tile timing")
    return choose()


def _launch_once(run: Any) -> float:
    run()
    return 0.0


def _install_gemv(inner: Any, compiles: CompilePool | None) -> None:
    """Batch-1 matmuls through the Triton GEMV where it beats cuBLAS on this GPU (timed per
    matrix shape at start-up, worker/device/kernels/gemv.py); the LM head too, which the decode step
    calls with F.linear (``inner._decode_lm_head_gemv``). TOKENPIPE_NO_GEMV=1 skips it."""
    from worker.device.kernels import triton_available

    if not triton_available() or not hasattr(inner, "model"):
        return
    from worker.device.kernels import gemv
    from worker.layers.quant import QuantLinear

    matrices = gemv.gemv_matrices(inner)
    head = None
    if not isinstance(inner.lm_head, QuantLinear):  # quantized: quant_matmul's kernels
        head = inner.model.embed_tokens.weight if inner.lm_head is None else inner.lm_head.weight
        if all(m.shape != head.shape for m in matrices):  # a tied embedding is no nn.Linear
            matrices.append(head)
    compile_ahead(compiles, [lambda: gemv.launch_candidates(matrices)], "GEMV timing")
    chosen = gemv.install_decode_gemv(inner)
    if head is None:
        faster = sum(c is not None for c in chosen.values())
        _log(f"cuda_setup: Triton GEMV for {faster} of {len(chosen)} float matrix shapes; the "
             "quantized matmuls run the W4A16/W8A16 kernels")  # fmt: skip
        return
    shape = (head.shape[0], head.shape[1])
    if shape not in chosen:  # a tied embedding is no nn.Linear
        chosen[shape] = gemv.choose_config(head)
    inner._decode_lm_head_gemv = chosen[shape]
    faster = sum(c is not None for c in chosen.values())
    _log(f"cuda_setup: Triton GEMV for {faster} of {len(chosen)} matrix shapes")
