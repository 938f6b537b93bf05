"""``--gpu-memory-gb``: hold a worker to a card's worth of device memory.

A worker on an 80-141 GB GPU can be told to behave as on a 24 GB card (to check that a model
and its sessions fit before buying one, or to leave the rest of a shared GPU to others). The
limit counts everything the process holds on the device: what the CUDA context and any other
process hold when it is set comes off the top, and torch's caching allocator gets the rest
(``torch.cuda.set_per_process_memory_fraction``), CUDA graphs' pools included. The default
context and the prefix cache are then sized from what is left under the limit, not from the
card's free memory, and running out while loading or building the cache says which limit.

What the limit cannot see: memory CUDA takes outside the allocator after it is set (kernel
code as modules load, a graph's own launch data), tens of MB here, so a limit a little under
the card's size is the faithful one (a "24 GB" card reports about 23.6-24 GiB in total).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1 << 30

GRAPHS_BYTES = 1 << 28
"""The engine's CUDA graphs' pools, sampling buffers and the like, beside the weights and caches:
0.10-0.35 GiB measured on the Gemma 4 31B and Qwen3.5 shapes (BENCHMARKS.md, session 31)."""

CUDA_PREFILL_CHUNK = 2048
"""The default prefill chunk on CUDA (``--prefill-chunk``; 512 on the CPU)."""
QUANTIZED_PREFILL_CHUNK = 4096
"""The default prefill chunk on CUDA for a model whose prefill dequantizes quantized weights a
chunk at a time, where the step fits beside the caches and the load's holes (else the 2,048
default's fit, as for float weights): each chunk dequantizes every quantized dense matmul's
weights once (``quant_matmul._dequantized_linear``), and a sparse MoE's quantized experts
into their float scratch, so a longer chunk spreads that over more tokens. Through the worker
on an H100, a 16k prompt: Gemma 4 31B int4 6,768 / 7,204 / 7,342 tok/s at 2,048 / 4,096 /
8,192, int8 6,657 / 7,118 at 2,048 / 4,096, with bf16 weights 4,096 gains 0.3% (session 46);
Qwen3.5-35B-A3B int4 experts 14,687 / 18,871 (session 47). Not 8,192:
a decoding session waits for one chunk at most (``scheduler.plan_step``), ~0.6 s at 4,096 on
that card, twice that at 8,192."""
MIN_PREFILL_CHUNK = 256
"""The worker halves its default prefill chunk until a step fits, never below this."""

PREFILL_SCRATCH_BYTES = 64 << 20
"""A quantized matmul's dequantized scratch in a prefill step (``quant_matmul.SCRATCH_BYTES``)."""

DELTANET_FLOATS_PER_HEAD_DIM = 18
"""The torch form of the gated delta rule (``deltanet.chunked_gated_delta_rule``) holds about
this many fp32 [heads, tokens, head_dim] tensors at once (q, k, v, their gated and decayed
copies, the triangular solve's two-wide right side and solution, the output), beside four
[heads, tokens, 64] chunk matrices: fitted to Qwen3.5-35B-A3B's 2,048-token step, 0.70 GiB."""

DELTANET_FLA_FLOATS_PER_HEAD_DIM = 6
"""The same for flash-linear-attention's chunk kernels (``deltanet.fla_chunk_rule``), which keep
bf16 inputs and per-chunk states instead of the fp32 form's copies: fitted to Qwen3.5-35B-A3B's
2,048-token step with fla 0.6, 0.32 GiB (BENCHMARKS.md, session 32)."""


MIN_PREFIX_TOKENS = 1024
"""The default shared-prefix pool is left off where it could not hold this many tokens of the
model's cache (a hybrid pool's unit: four 256-token blocks and one DeltaNet state). A pool of
none still had a hybrid model's prefill keep its states at block ends and fit a smaller chunk:
the Qwen3.5 file under 23.5 GiB got 67 MB of pool (0 blocks) and a 1,024-token chunk, 2,048
without it (BENCHMARKS.md, session 32)."""

PREFIX_POOL_SHARE = 0.15
PREFIX_POOL_MAX_BYTES = 8 << 30


def default_prefix_pool_bytes(room: int) -> int:
    """The default shared-prefix pool on CUDA out of `room` bytes (the device memory the weights
    left, less a prefill step, the graphs and any fixed sessions' caches): 15% of it, at most 8
    GiB (a 9k-token prefix of Gemma 4 31B, 0.9 MB of KV a position)."""
    return min(PREFIX_POOL_MAX_BYTES, int(PREFIX_POOL_SHARE * max(0, room)))


def prefill_step_bytes(
    config: dict[str, Any], chunk: int, dtype: Any, state_every: int = 0, fla: bool = False
) -> int:
    """The activations one prefill step of `chunk` tokens holds at its peak, from a model's
    (text) config: at the MLP the residual and its normed copy, the gate_up output, the
    activation and its product (dense: 2 x hidden + 4 x intermediate a token); a sparse MoE's
    top-k gathered rows with their own gate_up / down outputs, beside the shared expert; a
    DeltaNet layer's fp32 chunk form (``DELTANET_FLOATS_PER_HEAD_DIM``), or fla's kernels where
    `fla` (``DELTANET_FLA_FLOATS_PER_HEAD_DIM``); plus a quantized
    matmul's dequantized scratch. Attention's peak is lower (its kernels keep no [chunk,
    context] scores). With the prefix cache on (`state_every`: its block), a hybrid model's
    step also keeps every DeltaNet layer's state at each block end it passes (fp32). Measured
    as peak allocated over the steady state (BENCHMARKS.md, session 31), prefix cache off:
    Gemma 4 31B bf16 0.24 / 0.42 GiB at 1,024 / 2,048 tokens (this: 0.28 / 0.43), Qwen3.5
    35B-A3B 0.35 / 0.70 (0.41 / 0.70); with fla (session 32) 0.16 / 0.32 (0.20 / 0.33)."""
    import torch

    cfg = config.get("text_config") or config
    hidden = int(cfg["hidden_size"])
    element = torch.empty((), dtype=dtype).element_size()
    width = 4 * int(cfg.get("intermediate_size") or 0)
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        top_k = int(cfg.get("num_experts_per_tok") or 1)
        inner = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        width = max(width, top_k * (2 * hidden + 4 * inner) + 4 * shared)
    per_token = element * (2 * hidden + width)
    heads = int(cfg.get("linear_num_value_heads") or 0)
    states = 0
    if heads:  # fp32, whatever the model's dtype
        value_dim = int(cfg.get("linear_value_head_dim") or 0)
        key_dim = int(cfg.get("linear_key_head_dim") or value_dim)
        per_dim = DELTANET_FLA_FLOATS_PER_HEAD_DIM if fla else DELTANET_FLOATS_PER_HEAD_DIM
        floats = heads * (per_dim * value_dim + 4 * 64)
        per_token = max(per_token, element * 2 * hidden + 4 * floats)
        kinds = cfg.get("layer_types")
        n_layers = int(cfg.get("num_hidden_layers") or 0)
        interval = int(cfg.get("full_attention_interval") or 4)  # every 4th full without them
        layers = (
            sum(kind == "linear_attention" for kind in kinds)
            if kinds
            else n_layers - n_layers // interval
        )
        if state_every:
            states = chunk // state_every * layers * heads * key_dim * value_dim * 4
    return chunk * per_token + states + PREFILL_SCRATCH_BYTES


def fit_prefill_chunk(
    config: dict[str, Any],
    chunk: int,
    dtype: Any,
    room: int,
    state_every: int = 0,
    fla: bool = False,
) -> int | None:
    """`chunk` halved until a step (``prefill_step_bytes``) fits in `room` bytes, not below
    ``MIN_PREFILL_CHUNK``: the chunk the worker's default falls back to; None if none fits."""

    def fits(tokens: int) -> bool:
        return prefill_step_bytes(config, tokens, dtype, state_every, fla) <= room

    while chunk > MIN_PREFILL_CHUNK and not fits(chunk):
        chunk //= 2
    chunk = max(chunk, MIN_PREFILL_CHUNK)
    return chunk if fits(chunk) else None


@dataclass(frozen=True)
class MemoryLimit:
    """A device's limit: ``total`` bytes for the process, of which ``outside`` were held
    outside torch's allocator when it was set, so the allocator may reserve ``allocator``."""

    device: Any
    total: int
    outside: int

    @property
    def allocator(self) -> int:
        return self.total - self.outside


_LIMITS: dict[str, MemoryLimit] = {}


def indexed(device: Any) -> Any:
    """`device` as a ``torch.device`` with its index: a bare "cuda" is the current CUDA
    device (the key of anything kept per device); other devices as they are."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _key(device: Any) -> str:
    return f"cuda:{indexed(device).index}"


def apply(device: Any, gib: float, log: Any = None) -> MemoryLimit | None:
    """Cap the process's memory on `device` (CUDA) at `gib` GiB. None (and a log line) when
    the card has no more than that anyway; ValueError when the context and other processes
    already hold it."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-gb needs a CUDA device, not {device}")
    if gib <= 0:
        raise ValueError(f"--gpu-memory-gb must be above 0, got {gib}")
    key = _key(device)
    free, card = torch.cuda.mem_get_info(key)
    limit = int(gib * GIB)
    if limit >= card:
        if log is not None:
            log(f"--gpu-memory-gb {gib:g}: {key} has {card / GIB:.1f} GiB, so no limit")
        return None
    outside = card - free - torch.cuda.memory_reserved(key)  # the context, other processes
    if outside >= limit:
        raise ValueError(
            f"--gpu-memory-gb {gib:g}: the CUDA context and other processes already hold "
            f"{outside / GIB:.2f} GiB of {key}"
        )
    torch.cuda.set_per_process_memory_fraction((limit - outside) / card, key)
    _LIMITS[key] = MemoryLimit(key, limit, outside)
    if log is not None:
        log(
            f"device memory limited to {gib:g} GiB of {key}'s {card / GIB:.1f} "
            f"({outside / GIB:.2f} GiB held outside torch at start)"
        )
    return _LIMITS[key]


# the caching allocator's setting the worker starts with on CUDA unless PYTORCH_CUDA_ALLOC_CONF
# says otherwise: a weight's load and repack leaves temporaries of many sizes between the
# weights that stay, and fixed segments split around them hold the gaps (an int4 31B GGUF held
# to 23.5 GiB ran out packing with 18.5 GiB allocated, session 30); expandable segments map
# pages where they are needed, so freed gaps return to the pool
ALLOCATOR_SETTINGS = "expandable_segments:True"


def prefer_expandable_segments(log: Any = None) -> bool:
    """Let torch's CUDA allocator grow its segments in place (``ALLOCATOR_SETTINGS``) unless
    the user set PYTORCH_CUDA_ALLOC_CONF; before CUDA starts the environment carries it (and
    to processes this one starts), after it the allocator is told directly. False when the
    user's setting stands or this torch cannot take it."""
    import os

    import torch

    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS
    if torch.cuda.is_initialized():
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            return False
        try:
            setter(ALLOCATOR_SETTINGS)
        except RuntimeError as error:  # a build without it (ROCm, old drivers)
            if log is not None:
                log(f"allocator setting {ALLOCATOR_SETTINGS} not taken: {error}")
            return False
    return True


def limit_for(device: Any) -> MemoryLimit | None:
    return _LIMITS.get(_key(device)) if _LIMITS else None


FRAGMENTATION_BYTES = 1 << 28
"""Of the memory the allocator has not handed out, what a step may not get under a limit
(pages split between live blocks): 0.17 GiB reserved but unusable when the Qwen3.5 file's
prefill ran out under 23.5 GiB (BENCHMARKS.md, session 31), rounded up."""


def unallocated_bytes(device: Any) -> int:
    """What tensors could still get on `device`: the card's free memory plus the allocator's
    cached blocks, and under a limit at most the limit less what is allocated. (``free_bytes``
    leaves the cached blocks out: after a load they are mostly gaps the allocator reuses.)"""
    import torch

    key = _key(device)
    allocated = torch.cuda.memory_allocated(key)
    free = torch.cuda.mem_get_info(key)[0] + torch.cuda.memory_reserved(key) - allocated
    limit = _LIMITS.get(key)
    if limit is None:
        return int(free)
    return int(max(0, min(free, limit.allocator - allocated)))


def holes_bytes(device: Any) -> int:
    """What the allocator holds on `device` that no tensor does: after a load, mostly gaps
    between the weights (the packing's freed copies: 0.93 GiB after the 31B's quantize-at-load,
    session 47), usable by small blocks but not by a prefill step's large ones."""
    import torch

    key = _key(device)
    return max(0, int(torch.cuda.memory_reserved(key) - torch.cuda.memory_allocated(key)))


def free_bytes(device: Any) -> int:
    """Device memory still free for this process: the card's free memory, and under a
    limit at most what the allocator may still reserve."""
    import torch

    key = _key(device)
    free = torch.cuda.mem_get_info(key)[0]
    limit = _LIMITS.get(key)
    if limit is None:
        return int(free)
    return int(max(0, min(free, limit.allocator - torch.cuda.memory_reserved(key))))


def figures(device: Any) -> dict[str, int]:
    """The `stats` event's device memory figures (bytes)."""
    import torch

    key = _key(device)
    free, card = torch.cuda.mem_get_info(key)
    limit = _LIMITS.get(key)
    return {
        "device_memory_allocated": torch.cuda.memory_allocated(key),
        "device_memory_reserved": torch.cuda.memory_reserved(key),
        "device_memory_peak_allocated": torch.cuda.max_memory_allocated(key),
        "device_memory_peak_reserved": torch.cuda.max_memory_reserved(key),
        "device_memory_used": card - free,  # every process on the card, the context included
        "device_memory_limit": limit.total if limit is not None else card,
    }


def _outside(f: dict[str, int]) -> int:
    """What the card holds outside torch's allocator (the CUDA context, other processes), from
    `figures`."""
    return f["device_memory_used"] - f["device_memory_reserved"]


def summary(device: Any) -> str:
    """A start-up log line's figures: allocated, reserved, their peak, what the card holds
    outside torch's allocator (the CUDA context, other processes), and the limit."""
    f = figures(device)
    outside = _outside(f)
    return (
        f"{f['device_memory_allocated'] / GIB:.2f} GiB allocated, "
        f"{f['device_memory_reserved'] / GIB:.2f} reserved (peak "
        f"{f['device_memory_peak_reserved'] / GIB:.2f}), {outside / GIB:.2f} outside torch, "
        f"of {f['device_memory_limit'] / GIB:.1f}"
    )


def graph_pools(segments: list[dict[str, Any]]) -> tuple[int, int]:
    """(reserved, allocated) bytes of the allocator's private pools (CUDA graphs) in
    ``torch.cuda.memory_snapshot()``'s segments: a pool keeps the blocks its captures freed for
    their replays, so its reserved-but-unallocated bytes are no eager step's to use (a prefill
    step under a limit can fail with them "reserved but unallocated": session 39)."""
    private = [seg for seg in segments if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0)]
    reserved = sum(int(seg.get("total_size", 0)) for seg in private)
    return reserved, sum(int(seg.get("allocated_size", 0)) for seg in private)


def graph_pools_summary(device: Any) -> str:
    """``graph_pools`` for a log line: "0.41 GiB in CUDA graph pools (0.21 allocated)"; a
    snapshot torch cannot give says so instead (a log figure never stops a start-up)."""
    import torch

    try:
        index = torch.device(_key(device)).index
        segments = [seg for seg in torch.cuda.memory_snapshot() if seg.get("device") == index]
        reserved, allocated = graph_pools(segments)
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return f"CUDA graph pools not measured ({exc})"
    return f"{reserved / GIB:.2f} GiB in CUDA graph pools ({allocated / GIB:.2f} allocated)"


def over_limit(device: Any) -> str | None:
    """A warning when the process holds more than its --gpu-memory-gb: the CUDA context grows
    after the limit is set (kernel modules, the local memory of kernels that spill; 0.51 ->
    0.79 GiB on an H100, all of it by the end of start-up) and the allocator's cap cannot see
    that. None under the limit or without one."""
    f = figures(device)
    limit = _LIMITS.get(_key(device))
    if limit is None or f["device_memory_used"] <= limit.total:
        return None
    over = (f["device_memory_used"] - limit.total) / GIB
    return (
        f"warning: this process holds {f['device_memory_used'] / GIB:.2f} GiB, {over:.2f} over "
        f"--gpu-memory-gb {limit.total / GIB:g}: what the card holds outside torch's allocator "
        f"(the CUDA context, other processes) grew from {limit.outside / GIB:.2f} to "
        f"{_outside(f) / GIB:.2f} GiB after the "
        f"limit was set; a limit that much lower holds on a card of that size"
    )


def explain_out_of_memory(
    exc: BaseException, device: Any, what: str, quantize: str | None = None
) -> BaseException:
    """`exc` as the worker reports it when `what` (loading, the KV cache) ran out of device
    memory: which limit, and what to try (``--quantize int4`` unless ``quantize`` is int4
    already); other exceptions unchanged."""
    import torch

    if not isinstance(exc, torch.OutOfMemoryError) or torch.device(device).type != "cuda":
        return exc
    limit = limit_for(device)
    held = (
        f"the --gpu-memory-gb limit of {limit.total / GIB:.1f} GiB"
        if limit is not None
        else f"{torch.cuda.mem_get_info(_key(device))[1] / GIB:.1f} GiB"
    )
    tried = str(exc).split(". GPU")[0].removeprefix("CUDA out of memory. ")  # "Tried to ..."
    allocated = torch.cuda.memory_allocated(_key(device)) / GIB
    tries = ("" if quantize == "int4" else "--quantize int4, ") + "fewer --max-sessions"
    return MemoryError(
        f"out of device memory while {what} ({held} on {_key(device)}; {allocated:.2f} GiB "
        f"allocated, {tried[:1].lower() + tried[1:]}): "
        "`tokenpipe info --model M --quantize Q --context N` shows what the weights and a "
        f"session need; try {tries} or a shorter --max-context"
    )
