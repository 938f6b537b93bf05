"""The worker process: a stdin reader thread, the engine loop on the main thread, a writer.

stdout carries protocol lines only, one JSON object per line, flushed per line; logs and
load progress go to stderr. EOF on stdin (or a `shutdown` request) stops intake; the
loop finishes what is in flight, then the process exits 0.

`command` is `tokenpipe worker`; `seed_main` is the `tokenpipe-worker` console script,
the drop-in for the ExecuTorch llm_server control plane (`WORKER_BIN --model_path M
--tokenizer_path T`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import click
import msgspec

from protocol import (
    WORKER_MAX_LINE_BYTES,
    ErrorEvent,
    Event,
    ProtocolError,
    decode_request,
    encode_event,
    line_too_long,
)
from protocol.peek import PEEK_BYTES

_EOF = None
_DISCARD_READ = 1 << 16  # bytes per read while dropping the rest of a line over the limit


@dataclass(frozen=True)
class _TooLong:
    """A line over the limit: its first bytes (for its id), the rest was read and dropped."""

    prefix: bytes


def log(message: str) -> None:
    print(f"[tokenpipe worker] {message}", file=sys.stderr, flush=True)


def _read_lines(
    stream: BinaryIO, lines: queue.Queue[bytes | _TooLong | None], max_line_bytes: int
) -> None:
    """Reader thread: raw lines into `lines`, then the EOF marker. Memory per line is bounded
    by the limit: a longer line becomes a `_TooLong` as soon as the limit is passed."""
    cap = max_line_bytes + 2  # the content, then "\r\n"
    try:
        while True:
            line = stream.readline(cap + 1)
            if not line:
                break
            if len(line) <= cap or line.endswith(b"\n"):
                lines.put(line)  # decode_request checks the exact limit
                continue
            prefix = line[:PEEK_BYTES]
            while line and not line.endswith(b"\n"):
                line = stream.readline(_DISCARD_READ)
            lines.put(_TooLong(prefix))
    finally:
        lines.put(_EOF)


def serve(engine: object, stdin: BinaryIO, stdout: BinaryIO) -> int:
    """Run the protocol loop until EOF (or shutdown) and nothing is in flight."""
    from worker.engine.engine import Engine

    assert isinstance(engine, Engine)

    def write(events: list[Event]) -> None:
        for event in events:
            stdout.write(encode_event(event))
            stdout.flush()

    lines: queue.Queue[bytes | _TooLong | None] = queue.Queue()
    limit = WORKER_MAX_LINE_BYTES
    threading.Thread(target=_read_lines, args=(stdin, lines, limit), daemon=True).start()
    write([msgspec.structs.replace(engine.ready_event(), max_line_bytes=limit)])
    eof = False
    while True:
        # Take every line that is already there; block only when there is nothing to do.
        while not eof:
            block = engine.idle and not engine.shutting_down
            timeout = None
            if block and engine.idle_work():  # saved or pinned one session's cache; look again
                block = False
            elif block and engine.idle_soon():  # a pool buffer is coming back: poll for it
                timeout = 0.05
            try:
                line = lines.get(block=block, timeout=timeout)
            except queue.Empty:
                break
            if line is _EOF:
                eof = True
                break
            if isinstance(line, _TooLong):
                write(engine.submit_error(line_too_long(line.prefix, None, limit).to_event()))
                continue
            if not line.strip():
                continue
            decoded = decode_request(line, limit)
            if isinstance(decoded, ProtocolError):
                write(engine.submit_error(decoded.to_event()))
            else:
                write(engine.submit(decoded))
            if engine.shutting_down and engine.idle:
                break
        if engine.idle and (eof or engine.shutting_down):
            engine.close()  # --session-dir: every named session saved
            return 0
        write(engine.step())


WARM_PREFILL = "TOKENPIPE_WARM_PREFILL"
"""0: no prefill warm-up at a CUDA start (``Engine.warm_up_prefill``; the first long prompt then
compiles the prefill's kernels)."""

DEFAULT_CONTEXT = 32768
"""The default context (capped by the model's own and by memory)."""
CPU_KV_BUDGET = 2 << 30
"""KV bytes all sessions may take at the default context on the CPU. The default Gemma 3
270M costs 6 KiB a token (3 full layers x 1 KV head x 256 dims x K and V x fp32; its 15
sliding layers keep a fixed 512-token ring, 15.5 MiB a session), so 8 sessions of 32k take
1.7 GiB: agents' prompts (5-20k tokens) fit. A bigger model gets less, never below 4096."""
CPU_MIN_CONTEXT = 4096


def _session_kv_bytes(model: Any, context: int) -> int:
    """One session's cache bytes at `context` (the family's own cache: KV, and recurrent state
    and snapshots for hybrid models), laid out on the meta device (nothing allocated)."""
    return int(model.make_kv_cache(1, context, device="meta").bytes_per_slot)


def _slots_kv_bytes(model: Any, slots: int, context: int) -> int:
    """`slots` sessions' cache bytes at `context` (``_session_kv_bytes`` of the model under
    any CUDA-graph wrapper); 0 for a model without the meta layout."""
    try:
        return slots * _session_kv_bytes(getattr(model, "inner", model), context)
    except (AttributeError, TypeError, RuntimeError):
        return 0


def _memory_capped_context(
    model: Any, sessions: int, wanted: int, reserved: int = 0, quantize: str | None = None
) -> int:
    """The largest context <= `wanted` whose KV for `sessions` slots fits the memory budget
    (80% of free device memory on CUDA; on the CPU `CPU_KV_BUDGET`, or what
    `CPU_MIN_CONTEXT` tokens need if more, and at most half the available RAM). A cap on CUDA
    names `--quantize int4` where the weights are held otherwise (`quantize`, the worker's
    flag; None: not known, no hint)."""
    import psutil

    probe_len = 256
    device = next(iter(model.parameters())).device
    try:  # marginal cost per token past the sliding rings, and the rings' fixed cost
        long = max(wanted, 2 * probe_len)
        at_long = _session_kv_bytes(model, long)
        per_token = max(1, (_session_kv_bytes(model, 2 * long) - at_long) // long)
        fixed = max(0, at_long - per_token * long)
    except (AttributeError, TypeError, RuntimeError):  # a model without the usual layout
        probe = model.make_kv_cache(1, probe_len)
        per_token = max(1, int(getattr(probe, "bytes_per_slot", 0)) // probe_len)
        fixed = 0
        del probe
    if device.type == "cuda":  # less what the prefix cache may take (`reserved`)
        from worker.device import memory

        budget = max(memory.free_bytes(device) * 0.8 - reserved, 0)
    else:
        floor = sessions * (fixed + per_token * CPU_MIN_CONTEXT)
        budget = min(psutil.virtual_memory().available * 0.5, max(CPU_KV_BUDGET, floor))
    fits = int((budget / sessions - fixed) // per_token)
    capped = max(probe_len, min(wanted, fits // probe_len * probe_len))
    if capped < wanted:
        hint = ""
        if device.type == "cuda" and quantize not in (None, "int4"):  # a kept Q4_K_M, 24 GB
            hint = (
                "; --quantize int4 leaves more room (`tokenpipe info --model M --context N "
                "--gpu-memory-gb G` says what fits)"
            )
        if device.type == "cuda" and getattr(model, "kv_cache_dtype", None) is None:
            hint += "; --kv-cache-dtype fp8 holds twice the tokens"
        log(f"max context capped at {capped} tokens by memory ({sessions} sessions){hint}")
    return capped


def _fit_expert_scratch(model: Any, dtype: Any, device: Any, caches: int) -> bool:
    """Whether quantized experts may dequantize a prefill chunk's experts into a float scratch
    (``quant_experts.DEQUANT_SCRATCH``): only where twice the scratch (it, and the step's other
    work) fits beside the caches the engine is about to allocate (`caches` bytes); else the
    quantized grouped GEMMs, slower to prefill, with no scratch. Sets and returns it."""
    from worker.device import memory
    from worker.layers import quant_experts

    scratch = quant_experts.dequant_scratch_bytes(model, dtype)
    allowed = scratch == 0 or memory.free_bytes(device) - caches >= 2 * scratch
    quant_experts.DEQUANT_SCRATCH["allowed"] = allowed
    if not allowed:
        gib = scratch / (1 << 30)
        log(f"quantized experts: no room for a layer's {gib:.2f} GiB float scratch beside the "
            "caches; prefill runs the quantized grouped GEMMs")  # fmt: skip
    return allowed


def _quantized_matmuls(model: Any) -> tuple[bool, bool]:
    """Whether `model` has a ``QuantLinear`` besides its LM head (which a prefill step runs on
    its last rows only), and whether it has quantized experts."""
    from worker.layers.quant import QuantLinear
    from worker.layers.quant_experts import QuantExperts

    head = getattr(model, "lm_head", None)
    modules = list(model.modules())
    dense = any(isinstance(m, QuantLinear) and m is not head for m in modules)
    return dense, any(isinstance(m, QuantExperts) for m in modules)


def _dequantizes_per_chunk(model: Any) -> bool:
    """Whether `model`'s prefill dequantizes quantized weights a chunk at a time: dense
    quantized matmuls, or quantized experts with their float scratch allowed
    (``_fit_expert_scratch``, which runs first; without it they run grouped GEMMs on the
    codes)."""
    from worker.layers import quant_experts

    dense, experts = _quantized_matmuls(model)
    return dense or (experts and bool(quant_experts.DEQUANT_SCRATCH.get("allowed")))


def _reserve_quant_scratch(model: Any, device: Any) -> int:
    """The quantized matmuls' prefill scratch allocated now, before the caches, where `model`
    has quantized linear layers besides its LM head (which a prefill step runs on its last
    rows only) (``quant_matmul.reserve_scratch``: later, under a card's limit, only holes may
    be left for it). Its bytes, which the chunk's fit then counts as held (0: none, or no room
    for it now; a step then allocates its own, as without)."""
    import torch

    if not _quantized_matmuls(model)[0]:
        return 0
    from worker.device.kernels.quant_matmul import reserve_scratch

    try:
        return reserve_scratch(device)
    except torch.OutOfMemoryError:
        return 0


def _fit_prefill_chunk(
    model_config: dict[str, Any],
    config: Any,
    dtype: Any,
    device: Any,
    caches: int,
    chosen: bool,
    scratch: int = 0,
    preferred: int = 0,
) -> int:
    """The prefill chunk whose step's activations (``memory.prefill_step_bytes``) fit beside
    the caches about to be allocated (`caches` bytes), the CUDA graphs and a margin for
    fragmentation (``memory.unallocated_bytes``, less ``GRAPHS_BYTES``, less
    ``FRAGMENTATION_BYTES``), for `config`'s chunk and prefix block: the default halved
    until it does (not below ``MIN_PREFILL_CHUNK``), with a log line; a chunk the user chose is
    kept, with a warning. Without it a 24 GB card could start and then fail its first long
    prompt (session 31: the Qwen3.5 Q4_K_M file with two 16k slots under 23.5 GiB).
    `scratch`: the bytes of the step's quantized scratch already allocated
    (``_reserve_quant_scratch``), which the step's estimate counts too. `preferred` (a default
    chunk, ``memory.QUANTIZED_PREFILL_CHUNK``, capped by the context): taken, with a log line,
    where its step fits in that room less the allocator's holes (``memory.holes_bytes``: on a
    24 GB card's limit the 31B's 4,096 passed the plain fit and ran out at the warm-up,
    session 47); else the fit of `config`'s chunk as above, in silence where that one
    fits."""
    from worker.device import memory

    chunk, every = config.prefill_chunk, config.prefix_block if config.prefix_cache_bytes else 0
    room = memory.unallocated_bytes(device) - caches - memory.GRAPHS_BYTES + scratch
    room -= memory.FRAGMENTATION_BYTES
    fla = _fla_prefill(model_config, device, dtype)
    preferred = min(preferred, config.max_context)  # no prompt is longer than a session
    if preferred > chunk and not chosen:  # with the load's holes left out of the room
        beside = room - memory.holes_bytes(device)
        if memory.prefill_step_bytes(model_config, preferred, dtype, every, fla) <= beside:
            log(f"prefill chunk {preferred}: quantized weights, which a prefill step "
                "dequantizes once a chunk")  # fmt: skip
            return preferred
    need = memory.prefill_step_bytes(model_config, chunk, dtype, every, fla)
    if need <= room:
        return chunk
    if chosen:
        log(f"warning: a --prefill-chunk {chunk} step needs about {need / memory.GIB:.2f} GiB of "
            f"device memory and {max(room, 0) / memory.GIB:.2f} GiB is left beside the caches; "
            "long prompts may fail out of memory (a smaller --prefill-chunk, fewer sessions or a "
            "shorter context leave more)")  # fmt: skip
        return chunk
    fitted = memory.fit_prefill_chunk(model_config, chunk, dtype, room, every, fla)
    fitted = fitted or memory.MIN_PREFILL_CHUNK
    log(f"prefill chunk {fitted}: a {chunk}-token step needs about {need / memory.GIB:.2f} GiB "
        f"of device memory and {max(room, 0) / memory.GIB:.2f} GiB is left beside the "
        "caches")  # fmt: skip
    return fitted


def _fla_prefill(model_config: dict[str, Any], device: Any, dtype: Any) -> bool:
    """Whether this worker's DeltaNet prefill goes through flash-linear-attention's kernels
    (a hybrid model on CUDA in bf16/fp16 with ``fla`` importable): their step holds half the
    torch form's activations (``memory.prefill_step_bytes``). False for other models, without
    importing fla."""
    import torch

    from worker.loading.checkpoint import text_config

    if not text_config(model_config).get("linear_num_value_heads"):
        return False
    if torch.device(device).type != "cuda":
        return False
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    from worker.layers import deltanet

    return deltanet.fla_chunk_rule() is not None


def _useful_prefix_gb(model: Any, gb: float, chosen: bool = False) -> float:
    """`gb`, or 0 with a log line where a pool of `gb` GiB could not hold
    ``memory.MIN_PREFIX_TOKENS`` tokens of `model`'s cache; a size the user `chosen` is kept,
    with a warning."""
    from worker.device.memory import GIB, MIN_PREFIX_TOKENS

    need = _slots_kv_bytes(model, 1, MIN_PREFIX_TOKENS) / GIB
    if gb >= need:
        return gb
    if chosen:
        log(f"warning: --prefix-cache-gb {gb:g} holds less than {MIN_PREFIX_TOKENS} tokens of "
            f"this model ({need:.2f} GiB); 0 turns the prefix cache off")  # fmt: skip
        return gb
    log(f"prefix cache off: the {gb:.2f} GiB left for it would hold less than "
        f"{MIN_PREFIX_TOKENS} tokens ({need:.2f} GiB)")  # fmt: skip
    return 0.0


def _default_prefix_cache_gb(device: Any, taken: int = 0) -> float:
    """The shared-prefix pool on CUDA: 8 GiB (a 9k-token prefix of Gemma 4 31B, 0.9 MB of
    KV a position), at most 15% of the device memory the weights left free (under
    --gpu-memory-gb, of what the limit leaves), less `taken` (a prefill step's activations, the
    CUDA graphs, and the sessions' KV when --max-context fixes it: on a 24 GB card the sessions
    asked for come first)."""
    if device.type != "cuda":
        return 0.0
    from worker.device import memory

    return memory.default_prefix_pool_bytes(memory.free_bytes(device) - taken) / (1 << 30)


@contextlib.contextmanager
def _explained(device: Any, what: str, quantize: str | None = None) -> Iterator[None]:
    """Out of device memory while doing `what`: say which limit and what to try."""
    from worker.device import memory

    try:
        yield
    except Exception as exc:
        explained = memory.explain_out_of_memory(exc, device, what, quantize)
        if explained is exc:
            raise
        raise explained from exc


def _parse_prefix_ids(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return ()
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated token ids, got {value!r}") from None


def _check_cuda(device: Any) -> None:
    """A ValueError that says why, before anything loads, when `device` (``--device cuda:N``)
    is not a CUDA device this process can use (torch's own is an AssertionError)."""
    import torch

    if torch.version.cuda is None:
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) has no CUDA")
    count = torch.cuda.device_count()
    index = device.index or 0
    if index >= count:
        raise ValueError(
            f"--device {device}: {count} CUDA device(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )


def build_engine(
    model: str | None,
    tokenizer_path: str | None,
    device: str | None,
    dtype: str | None,
    max_sessions: int,
    max_context: int | None,
    prefill_chunk: int | None,
    prefix_ids: str | None,
    warm_resume: bool,
    random_weights: bool,
    seed: int,
    threads: int | None,
    cuda_graphs: bool = True,
    quantize: str = "none",
    group_size: int | None = None,
    quant_importance: str | None = None,
    max_resident: int | None = None,
    host_cache_gb: float = 4.0,
    session_dir: str | None = None,
    prefix_cache_gb: float | None = None,
    gpu_memory_gb: float | None = None,
    kv_cache_dtype: str = "auto",
    group: Any = None,
) -> object:
    """Load the model and build the engine (load progress on stderr). With `group` (a
    `worker.parallel.group.TensorParallelGroup`), this rank's slice of the model; a follower
    rank gets `(model, device)` back instead of an engine (`worker/parallel/follower.py`)."""
    import torch

    from worker.engine.engine import Engine, EngineConfig
    from worker.layers.kv import kv_cache_dtype as parse_kv_dtype
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.loading.startup_clock import StartupClock

    kv_dtype = parse_kv_dtype(kv_cache_dtype)  # a bad value fails before the load
    if threads:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # denormal activations are very slow on x86 CPUs
    device_name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_device = torch.device(device_name)
    if torch_device.type == "cuda" and group is None:
        _check_cuda(torch_device)
    if torch_device.type == "cuda":
        from worker.device import memory

        memory.prefer_expandable_segments(log)  # before the first allocation
    if torch_device.type == "cpu" and group is None:
        from worker.device import cpu_gemv

        # the kernels keep every thread; the engine runs decode steps' torch ops on one
        cpu_gemv.set_kernel_threads(torch.get_num_threads())
    if group is not None:
        torch_device = group.device(torch_device)
    on_cpu = torch_device.type == "cpu"
    dtype_name = dtype or ("float32" if on_cpu else "bfloat16")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype_name
    ]
    torch.manual_seed(seed)
    from worker.device import memory

    if gpu_memory_gb is not None:  # before anything is allocated on the device
        memory.apply(torch_device, gpu_memory_gb, log)
    clock = StartupClock(log)
    compiles = None
    if torch_device.type == "cuda" and group is None:
        from worker.device.compile_ahead import start_compile_pool

        compiles = start_compile_pool()  # its processes start up while the weights load
    log(f"loading {model or 'the default model'} on {torch_device} as {dtype_name}")
    with clock.step("loaded"), _explained(torch_device, "loading the weights", quantize):
        loaded = load_model(
            model,
            torch_device,
            torch_dtype,
            random_weights=random_weights,
            tokenizer_path=tokenizer_path,
            seed=seed,
            quantize=QuantizeOptions(quantize, group_size, quant_importance),
            shard=group,
        )
    if kv_dtype is not None:  # before anything sizes the cache
        loaded.model.kv_cache_dtype = kv_dtype
        share = kv_dtype.itemsize / torch_dtype.itemsize
        log(
            f"KV cache in {kv_cache_dtype} ({str(kv_dtype).removeprefix('torch.')}): {share:g} "
            f"of {dtype_name}'s bytes"
            + (" (the CPU's C attention takes only float32)" if on_cpu else "")
        )
    model_context = int(getattr(loaded.config, "context_length", 0) or 4096)
    default_context = min(model_context, DEFAULT_CONTEXT)
    if max_resident is not None and max_resident > max_sessions:
        raise ValueError(f"--max-resident {max_resident} is above --max-sessions {max_sessions}")
    resident = max_resident or max_sessions
    chunk_tokens = prefill_chunk or (512 if on_cpu else memory.CUDA_PREFILL_CHUNK)
    if prefix_cache_gb is None and on_cpu:
        prefix_cache_gb = _useful_prefix_gb(loaded.model, 0.25)
    elif prefix_cache_gb is None:
        taken = 0 if max_context is None else _slots_kv_bytes(loaded.model, resident, max_context)
        fla = _fla_prefill(loaded.config.raw, torch_device, torch_dtype)
        taken += memory.GRAPHS_BYTES + memory.prefill_step_bytes(  # a prefill step's room
            loaded.config.raw, chunk_tokens, torch_dtype, fla=fla
        )
        prefix_cache_gb = _default_prefix_cache_gb(torch_device, taken)
        prefix_cache_gb = _useful_prefix_gb(loaded.model, prefix_cache_gb)
    elif prefix_cache_gb > 0:
        _useful_prefix_gb(loaded.model, prefix_cache_gb, chosen=True)  # kept, with a warning
    prefix_bytes = int(prefix_cache_gb * (1 << 30))
    if max_context is None:
        default_context = _memory_capped_context(
            loaded.model, resident, default_context, reserved=prefix_bytes, quantize=quantize
        )
    if group is not None:
        if torch_device.type == "cuda":
            loaded.model.fuse_projections()  # eager in a group: no graphs, no decode ahead
        if group.rank > 0:
            return loaded.model, torch_device
        from worker.parallel.driver import DriverModel

        loaded.model = DriverModel(loaded.model, group)
    elif torch_device.type == "cuda":
        from worker.device.cuda_setup import prepare_model_for_device

        # the load's own peak, apart from the packing's (the 31B from bf16 files under a 24 GB
        # card's limit: 19.48 GiB reserved after the load, 22.97 after the packing; session 48)
        log(f"device memory: {memory.summary(torch_device)} after the load")
        # merged projections, fused kernels, decode steps replayed from CUDA graphs
        with _explained(torch_device, "packing the weights for the GPU kernels", quantize):
            loaded.model = prepare_model_for_device(
                loaded, torch_device, random_weights, seed, cuda_graphs=cuda_graphs,
                clock=clock, compiles=compiles,
            )  # fmt: skip
    config = EngineConfig(
        max_sessions=max_sessions,
        max_context=min(max_context or default_context, model_context),
        prefill_chunk=chunk_tokens,
        warm_resume=warm_resume,
        prefix_ids=_parse_prefix_ids(prefix_ids),
        max_resident=max_resident,
        host_cache_bytes=int(host_cache_gb * (1 << 30)),
        session_dir=session_dir,
        prefix_cache_bytes=prefix_bytes,
    )
    with clock.step("KV cache and CUDA graphs" if torch_device.type == "cuda" else "KV cache"):
        if torch_device.type == "cuda":
            log(f"device memory: {memory.summary(torch_device)} with the weights")
            slots = _slots_kv_bytes(loaded.model, config.resident, config.max_context)
            caches = config.prefix_cache_bytes + slots
            _fit_expert_scratch(loaded.model, torch_dtype, torch_device, caches)
            scratch = _reserve_quant_scratch(loaded.model, torch_device)
            longer = _dequantizes_per_chunk(loaded.model)  # the quantized weights' chunk
            preferred = memory.QUANTIZED_PREFILL_CHUNK if longer else 0
            chunk = _fit_prefill_chunk(
                loaded.config.raw, config, torch_dtype, torch_device, caches,
                chosen=prefill_chunk is not None, scratch=scratch, preferred=preferred,
            )  # fmt: skip
            config = dataclasses.replace(config, prefill_chunk=chunk)
            from worker.device.graphed_lm import GraphedCausalLM

            if isinstance(loaded.model, GraphedCausalLM):  # its compile trace's prefill steps
                loaded.model.trace_chunk = chunk
                loaded.model.trace_block = config.prefix_block if config.prefix_cache_bytes else 0
            building = (
                f"building the KV cache ({config.resident} device slots of {config.max_context} "
                f"tokens: {slots / memory.GIB:.2f} GiB, a prefix pool of "
                f"{config.prefix_cache_bytes / memory.GIB:.2f} GiB; "
                f"{memory.unallocated_bytes(torch_device) / memory.GIB:.2f} GiB was left after "
                "the weights) and CUDA graphs"
            )
        else:
            building = "building the KV cache"
        with _explained(torch_device, building, quantize):
            engine = Engine(loaded, config, torch_device, log=log)
        if torch_device.type == "cuda":
            log(f"device memory: {memory.summary(torch_device)} with the caches and graphs; "
                f"{memory.graph_pools_summary(torch_device)}")  # fmt: skip
    if torch_device.type == "cuda":
        if group is None and os.environ.get(WARM_PREFILL) != "0":
            with clock.step("prefill warm-up"):
                _warm_up(engine, chosen=prefill_chunk is not None)
        torch.cuda.reset_peak_memory_stats(torch_device)  # `stats`' peaks: while serving
        if warning := memory.over_limit(torch_device):
            log(warning)
    if compiles is not None:
        compiles.close()
    log(
        f"ready: {config.max_sessions} sessions ({config.resident} on the device) x "
        f"{config.max_context} tokens, "
        f"prefill chunk {engine.prefill_chunk} ({clock.summary()})"
    )
    return engine


def _warm_up(engine: Any, chosen: bool) -> None:
    """The prefill warm-up (``Engine.warm_up_prefill``). Where it runs out of device memory at
    the default chunk, the chunk is halved and the warm-up run again, down to
    ``MIN_PREFILL_CHUNK``: the fit before the caches (``_fit_prefill_chunk``) is an estimate,
    and a worker that starts at the edge of its limit would otherwise fail its first long
    prompt the same way (session 37: Gemma 4 31B Q4_K_M kept, two 8k slots under 23.5 GiB,
    64 MiB short at a 2,048 chunk). Any other failure, or a chunk the user chose, is a
    warning; the worker serves on."""
    import torch

    from worker.device.memory import MIN_PREFILL_CHUNK

    while True:
        try:
            engine.warm_up_prefill()
            return
        except RuntimeError as exc:
            chunk = engine.prefill_chunk
            if chosen or chunk <= MIN_PREFILL_CHUNK or "out of memory" not in str(exc).lower():
                log(f"warning: {exc}")
                return
            engine.prefill_chunk = max(MIN_PREFILL_CHUNK, chunk // 2)
            torch.cuda.empty_cache()
            tried = re.search(r"tried to allocate ([\d.]+ [KMGT]?i?B)", str(exc), re.IGNORECASE)
            short = f" (a {tried.group(1)} allocation failed)" if tried else ""
            log(f"prefill chunk {engine.prefill_chunk}: the warm-up ran out of device memory at "
                f"{chunk} tokens a step{short}")  # fmt: skip


def _options(func: click.decorators.FC) -> click.decorators.FC:
    opts = [
        click.option(
            "--model",
            "--model_path",
            "model",
            default=None,
            help="HF checkpoint dir or .gguf file (default: packaged Gemma 3 270M).",
        ),
        click.option(
            "--tokenizer_path",
            "--tokenizer-path",
            "tokenizer_path",
            default=None,
            help="A tokenizer.json overriding the model's own tokenizer.",
        ),
        click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)."),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default=None,
            help="Default: float32 on CPU, bfloat16 on CUDA.",
        ),
        click.option(
            "--max-sessions",
            type=click.IntRange(min=1),
            default=8,
            show_default=True,
            help="Sessions, the scratch one included (see --max-resident).",
        ),
        click.option(
            "--max-resident",
            type=click.IntRange(min=1),
            default=None,
            help="Sessions whose cache is on the device at once (KV slots; default: "
            "--max-sessions). Idle ones beyond it wait in host memory, then --session-dir.",
        ),
        click.option(
            "--host-cache-gb",
            type=click.FloatRange(min=0),
            default=4.0,
            show_default=True,
            help="Host memory for idle sessions' caches (pinned on CUDA).",
        ),
        click.option(
            "--session-dir",
            default=None,
            help="Save named sessions here (when idle and at shutdown); restored at start.",
        ),
        click.option(
            "--prefix-cache-gb",
            type=click.FloatRange(min=0),
            default=None,
            help="Device memory for shared prompt blocks (default 0.25 on CPU; on CUDA 8, at "
            "most 15% of the memory the weights leave; 0 turns it off).",
        ),
        click.option(
            "--max-context",
            type=click.IntRange(min=1),
            default=None,
            help="Tokens per session (default: the model's up to 32768, capped by memory).",
        ),
        click.option(
            "--prefill-chunk",
            type=click.IntRange(min=1),
            default=None,
            help="Most prompt tokens per step (default 512 on CPU, 2048 on CUDA; 4096 where "
            "the matmuls are quantized and the step fits).",
        ),
        click.option(
            "--prefix-ids",
            default=None,
            help="Comma-separated ids prepended to prompts (overrides BOS).",
        ),
        click.option("--no-warm-resume", is_flag=True, help="Always re-prefill the whole prompt."),
        click.option("--random-weights", is_flag=True, help="Random weights (config only)."),
        click.option(
            "--seed", type=int, default=0, show_default=True, help="Seed for --random-weights."
        ),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            default=None,
            help="CPU threads for torch (default: torch's).",
        ),
        click.option(
            "--cuda-graphs/--no-cuda-graphs",
            default=True,
            show_default=True,
            help="Replay decode steps from CUDA graphs (CUDA only).",
        ),
        click.option(
            "--quantize",
            type=click.Choice(["auto", "none", "int8", "int4", "int4-mixed", "int4-experts"]),
            default="auto",
            show_default=True,
            help="Weights: auto keeps a GGUF's quantized tensors; int8/int4 quantize at load "
            "(int4-mixed: every v_proj and some down_proj int8, for quality; int4-experts: a "
            "MoE's routed experts int4, the LM head int8, the other matmuls float).",
        ),
        click.option(
            "--tensor-parallel",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Ranks in this worker's group (one per visible GPU; gloo processes on the CPU).",
        ),
        click.option(
            "--group-size",
            type=click.IntRange(min=2),
            default=None,
            help="Quantization group size (default 32; 64, 128 or the row length also work).",
        ),
        click.option(
            "--gpu-memory-gb",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Device memory this worker may hold, the CUDA context included, as if the "
            "card had that much (default: all of it); the default context and the prefix "
            "cache are sized within it.",
        ),
        click.option(
            "--kv-cache-dtype",
            type=click.Choice(["auto", "fp8"]),
            default="auto",
            show_default=True,
            help="The KV cache's format: auto is the model's dtype; fp8 (e4m3, no scale) "
            "holds twice the tokens in the same memory.",
        ),
        click.option(
            "--quant-importance",
            default=None,
            help="int4 fit weighted by input channel: a file of tools/quant_importance.py "
            "(default: the default model's shipped one; none: the plain fit).",
        ),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


@click.command(name="worker")
@_options
def command(
    model: str | None,
    tokenizer_path: str | None,
    device: str | None,
    dtype: str | None,
    max_sessions: int,
    max_context: int | None,
    prefill_chunk: int | None,
    prefix_ids: str | None,
    no_warm_resume: bool,
    random_weights: bool,
    seed: int,
    threads: int | None,
    cuda_graphs: bool,
    quantize: str,
    tensor_parallel: int,
    group_size: int | None,
    quant_importance: str | None,
    max_resident: int | None,
    host_cache_gb: float,
    session_dir: str | None,
    prefix_cache_gb: float | None,
    gpu_memory_gb: float | None,
    kv_cache_dtype: str,
) -> None:
    """Run one worker process: JSONL requests on stdin, JSONL events on stdout."""
    build = dict(
        model=model,
        tokenizer_path=tokenizer_path,
        device=device,
        dtype=dtype,
        max_sessions=max_sessions,
        max_context=max_context,
        prefill_chunk=prefill_chunk,
        prefix_ids=prefix_ids,
        warm_resume=not no_warm_resume,
        random_weights=random_weights,
        seed=seed,
        threads=threads,
        cuda_graphs=cuda_graphs,
        quantize=quantize,
        group_size=group_size,
        quant_importance=quant_importance,
        max_resident=max_resident,
        host_cache_gb=host_cache_gb,
        session_dir=session_dir,
        prefix_cache_gb=prefix_cache_gb,
        gpu_memory_gb=gpu_memory_gb,
        kv_cache_dtype=kv_cache_dtype,
    )
    group = None
    try:
        if tensor_parallel > 1:
            group = _start_group(tensor_parallel, device, build)
        engine = build_engine(**build, group=group)  # type: ignore[arg-type]
    except Exception as exc:
        log(f"failed to start: {exc!r}")
        sys.stdout.buffer.write(
            encode_event(ErrorEvent(error=f"failed to start: {exc}", code="internal_error"))
        )
        sys.stdout.buffer.flush()
        sys.exit(1)
    try:
        code = serve(engine, sys.stdin.buffer, sys.stdout.buffer)
    except BrokenPipeError:  # the reader went away: nothing left to answer
        log("stdout closed; exiting")
        code = 0
    if group is not None:
        group.stop()
    sys.exit(code)


def _start_group(world: int, device: str | None, build: dict[str, Any]) -> Any:
    """--tensor-parallel: start the other ranks and join them (worker/parallel/group.py)."""
    import torch

    from worker.parallel.group import start_group

    kind = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    if kind == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"--tensor-parallel {world}: {torch.cuda.device_count()} GPU(s) visible")
    return start_group(world, kind, build)


def seed_main() -> None:
    """`tokenpipe-worker`: the ExecuTorch llm_server drop-in (no subcommand)."""
    command.main(prog_name="tokenpipe-worker")


if __name__ == "__main__":
    seed_main()
