"""Weight-only quantized formats and the layers holding them (``QuantLinear``, ``QuantEmbedding``).

Three formats, all group-wise along the input dimension K of a weight [N, K]:

    int8  symmetric:   w[n, k] = q[n, k] * scale[n, k // g]             q int8 in [-127, 127]
    int4  asymmetric:  w[n, k] = q[n, k] * scale[n, k // g] + offset[n, k // g]   q in [0, 15]
    int6  symmetric:   as int8 with q in [-32, 31] (a GGUF's Q6_K: g16)

``g`` (the group size) divides K; ``g == K`` is one scale per output channel. Scales and
offsets are fp16 (a quarter of a byte per weight at int4 g32). The int4 offset is the group's
zero point as a float (offset = -zero * scale), so a GGUF Q4_K block (``d * sc * q - dmin * m``)
repacks into it up to the fp16 rounding of the two products.

The canonical layout, ``QuantizedWeight``, is row-major: int8 and int6 ``qdata`` int8 [N, K];
int4 ``qdata`` uint8 [N, K / 2], low nibble the even k. int6 differs from int8 only in the
range its codes keep: the CPU kernels take it as int8, the GPU packs it in 6 bits
(``worker.device.kernels.int6_matmul``). Device code repacks it for its kernels (the CPU:
``worker.device.cpu_quant``); the torch reference here (``dequantize``) is what every kernel is
tested against. Norms, biases and other vectors are never quantized.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INT8, INT4, INT6 = "int8", "int4", "int6"
KINDS = (INT8, INT4, INT6)
CODE_LIMIT = {INT8: 127, INT6: 31}  # a symmetric kind's fits keep codes within +-limit
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantFormat:
    """A weight's storage format: ``kind`` int8, int4 or int6 and ``group_size`` (0: one group per
    output channel, that is the whole row)."""

    kind: str
    group_size: int = 0

    def group_for(self, in_features: int) -> int:
        return self.group_size or in_features

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """ValueError naming the tensor unless a [N, K] weight of ``shape`` takes this format."""
        if self.kind not in KINDS:
            raise ValueError(f"tensor {name!r}: unknown quantized kind {self.kind!r}")
        if len(shape) != 2:
            raise ValueError(f"tensor {name!r}: only 2-D weights are quantized, got {shape}")
        k = shape[1]
        group = self.group_for(k)
        if k % group:
            raise ValueError(
                f"tensor {name!r} {list(shape)}: group size {group} does not divide its "
                f"input dimension {k} ({self.kind})"
            )
        if self.kind == INT4 and group % 2:
            raise ValueError(f"tensor {name!r}: int4 needs an even group size, got {group}")

    def describe(self) -> str:
        return f"{self.kind} g{self.group_size}" if self.group_size else f"{self.kind} per-channel"


@dataclass
class QuantizedWeight:
    """A quantized [N, K] weight in the canonical row-major layout (module docstring)."""

    kind: str
    shape: tuple[int, int]
    group_size: int
    qdata: torch.Tensor  # int8 [N, K] (int8, int6) | uint8 [N, K / 2] (int4)
    scales: torch.Tensor  # fp16 [N, K / g]
    offsets: torch.Tensor | None = None  # fp16 [N, K / g], int4 only

    @property
    def format(self) -> QuantFormat:
        return QuantFormat(self.kind, self.group_size)

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def nbytes(self) -> int:
        parts = [self.qdata, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self).to(dtype)

    def rows(self, ids: torch.Tensor) -> QuantizedWeight:
        """The rows ``ids`` (a row permutation, or an embedding lookup)."""
        offsets = None if self.offsets is None else self.offsets[ids]
        shape = (int(ids.numel()), self.shape[1])
        return QuantizedWeight(
            self.kind, shape, self.group_size, self.qdata[ids], self.scales[ids], offsets
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return QuantizedWeight(
            self.kind, self.shape, self.group_size, self.qdata.to(device),
            self.scales.to(device), offsets,
        )  # fmt: skip


def _groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    n, k = weight.shape
    return weight.float().reshape(n, k // group, group)  # [N, K / g, g]


# int8 scale candidates amax / m: m = 127 is round-to-nearest; smaller m clip nothing and
# trade range for a grid that may fit the group better. On the default model (whose float
# weights are dequantized Q5_0/Q8_0/Q6_K/Q4_K) the search finds the 5-bit grid of the Q5_0
# tensors exactly: int8 g32 top-1 97.3% -> 98.8%, perplexity +0.9% -> +0.3%.
INT8_DIVISORS = tuple(range(64, 128))  # int6: 16 to 31 (``quantize_int8``'s ``kind``)
# int4: each candidate spreads the group's [min, max] over 15 + delta steps, assigns codes, then
# fits scale and offset to those codes by least squares; the best by squared error is kept
# (llama.cpp's make_qkx2 idea, vectorised). Squared error -26% vs min/max round-to-nearest.
INT4_STEP_DELTAS = tuple(d / 10 for d in range(-10, 11))
SEARCH_ROWS = 512  # rows per chunk of a search: bounds its temporaries to a few MB
SEARCH_ELEMENTS_GPU = 1 << 24  # on a GPU, chunks of ~16M weights: few launches, ~400 MB


def _fit_in_one_launch(weight: torch.Tensor, group: int) -> bool:
    """The fits below as one Triton launch a weight (``worker.device.kernels.quant_fit``), for a
    weight on the GPU in groups of 16-256 (a power of two): the codes, scales and offsets of
    these torch passes (up to the order the sums add in), without their ~360 fp32 passes over
    the weight (int4; int8: ~500). On an H100 it fits each 31B matrix 32-39x faster with every
    group's scale equal, and a bf16 31B checkpoint loads in 12 s, not 54 (BENCHMARKS.md, session
    49). ``TOKENPIPE_QUANT_FIT=torch`` keeps the torch passes (for comparison); a CPU weight
    takes the kernel (Triton's interpreter, with TOKENPIPE_TRITON_CPU=1) only with
    ``TOKENPIPE_QUANT_FIT=kernel``, so the CPU tests of other paths keep the torch passes' pace."""
    from worker.device.kernels.attention import use_triton

    choice = os.environ.get("TOKENPIPE_QUANT_FIT")
    if choice == "torch" or not use_triton(weight):
        return False
    if not weight.is_cuda and choice != "kernel":
        return False
    return 16 <= group <= 256 and group & (group - 1) == 0 and weight.shape[0] > 0


def _search_rows(weight: torch.Tensor) -> int:
    if weight.device.type == "cpu":
        return SEARCH_ROWS
    return max(SEARCH_ROWS, SEARCH_ELEMENTS_GPU // max(1, weight.shape[1]))


def quantize_int8(
    weight: torch.Tensor, group_size: int = 0, search: bool = True, kind: str = INT8
) -> QuantizedWeight:
    """Symmetric int8, per group the scale amax / m (m in INT8_DIVISORS) with the least squared
    error (``search`` False: amax / 127, round-to-nearest); ``group_size`` 0: per channel.
    ``kind`` int6: codes up to 31 (m from 16 to 31)."""
    n, k = weight.shape
    group = group_size or k
    QuantFormat(kind, group).check("weight", (n, k))
    limit = CODE_LIMIT[kind]
    divisors = tuple(range((limit + 1) // 2, limit + 1)) if search else (limit,)
    if _fit_in_one_launch(weight, group):
        from worker.device.kernels.quant_fit import fit_int8

        q, scales = fit_int8(weight, group, divisors[0], limit)
        return QuantizedWeight(kind, (n, k), group, q, scales)
    rows = _search_rows(weight)
    scales, codes = [], []
    for start in range(0, n, rows):  # chunks bound the fp32 temporaries
        grouped = _groups(weight[start : start + rows], group)
        scale = _int8_scales(grouped, divisors, limit)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
        codes.append(torch.round(grouped / safe).clamp_(-limit, limit).to(torch.int8).flatten(1))
        scales.append(scale)
    q, scales = torch.cat(codes), torch.cat(scales)
    return QuantizedWeight(kind, (n, k), group, q, scales)


def _int8_scales(
    grouped: torch.Tensor, divisors: tuple[int, ...], limit: int = 127
) -> torch.Tensor:
    """[R, G, g] -> fp16 [R, G]: the candidate scale of least squared error per group."""
    amax = grouped.abs().amax(dim=-1, keepdim=True)  # [R, G, 1]
    best_scale = best_error = None
    for divisor in divisors:
        scale = (amax / divisor).to(SCALE_DTYPE).float()
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = torch.div(grouped, safe).round_().clamp_(-limit, limit)
        error = codes.mul_(scale).sub_(grouped).square_().sum(dim=-1, keepdim=True)
        if best_scale is None or best_error is None:
            best_scale, best_error = scale, error
            continue
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    assert best_scale is not None
    return best_scale.squeeze(-1).to(SCALE_DTYPE)


def quantize_int4(
    weight: torch.Tensor,
    group_size: int = 32,
    search: bool = True,
    importance: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Asymmetric int4: per group the scale and offset of least squared error among
    INT4_STEP_DELTAS' fits (``search`` False: min/max, scale = (max - min) / 15, offset = min).
    ``importance`` [K] (>= 0, e.g. each input channel's mean x^2 over calibration text) weights
    each weight's squared error by its input channel's, in the fit and in the choice."""
    n, k = weight.shape
    QuantFormat(INT4, group_size).check("weight", (n, k))
    weights = None if importance is None else _group_weights(importance, k, group_size, weight)
    if _fit_in_one_launch(weight, group_size):
        from worker.device.kernels.quant_fit import fit_int4

        factors = None if weights is None else weights.reshape(k)
        packed_codes, scale, offset = fit_int4(weight, group_size, search, factors)
        return QuantizedWeight(INT4, (n, k), group_size, packed_codes, scale, offset)
    rows = _search_rows(weight)
    scales, offsets, packed = [], [], []
    for start in range(0, n, rows):  # chunks bound the fp32 temporaries
        grouped = _groups(weight[start : start + rows], group_size)
        scale, offset = _int4_params(grouped, search, weights)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
        q = torch.round((grouped - offset.float().unsqueeze(-1)) / safe).clamp_(0, 15)
        packed.append(pack_nibbles(q.to(torch.uint8).flatten(1)))
        scales.append(scale)
        offsets.append(offset)
    return QuantizedWeight(INT4, (n, k), group_size, torch.cat(packed), torch.cat(scales),
                           torch.cat(offsets))  # fmt: skip


def _group_weights(
    importance: torch.Tensor, k: int, group: int, like: torch.Tensor
) -> torch.Tensor:
    """importance [K] -> [1, K / g, g] fp32 on ``like``'s device, each group's mean 1 (a floor
    of 1e-4 of it, so no weight is free and every fit stays determined)."""
    if tuple(importance.shape) != (k,):
        raise ValueError(f"importance of shape {tuple(importance.shape)} for a weight of K={k}")
    weights = importance.to(like.device, torch.float32).reshape(1, k // group, group)
    weights = weights / weights.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return weights.clamp_min(1e-4)


def _sum(t: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return (t if weights is None else t * weights).sum(-1, keepdim=True)


def _int4_params(
    grouped: torch.Tensor, search: bool, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, G, g] -> (scale, offset) fp16 [R, G] of least (``weights`` [1, G, g]: weighted)
    squared error per group."""
    low = grouped.amin(dim=-1, keepdim=True)  # [R, G, 1]
    span = grouped.amax(dim=-1, keepdim=True) - low
    best_scale = (span / 15.0).to(SCALE_DTYPE).float()  # min/max: the starting candidate
    best_offset = low.to(SCALE_DTYPE).float()
    if not search:
        return best_scale.squeeze(-1).to(SCALE_DTYPE), best_offset.squeeze(-1).to(SCALE_DTYPE)
    best_error = _int4_error(grouped, best_scale, best_offset, weights)
    size = grouped.shape[-1] if weights is None else weights.sum(-1, keepdim=True)
    sum_w = _sum(grouped, weights)
    nonzero_span = torch.where(span > 0, span, torch.ones_like(span))
    shifted = grouped - low  # the same for every candidate: one pass, not one a candidate
    for delta in INT4_STEP_DELTAS:
        codes = torch.mul(shifted, (15.0 + delta) / nonzero_span).round_().clamp_(0, 15)
        # (weighted) least squares of grouped ~ scale * codes + offset over each group
        sum_c = _sum(codes, weights)
        sum_cc = _sum(codes.square(), weights)
        sum_cw = _sum(codes.mul_(grouped), weights)
        det = size * sum_cc - sum_c * sum_c
        ok = det > 0
        scale = (size * sum_cw - sum_c * sum_w) / torch.where(ok, det, torch.ones_like(det))
        scale = torch.where(ok, scale, best_scale).to(SCALE_DTYPE).float()
        offset = ((sum_w - scale * sum_c) / size).to(SCALE_DTYPE).float()
        error = _int4_error(grouped, scale, offset, weights)
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_offset = torch.where(better, offset, best_offset)
        best_error = torch.where(better, error, best_error)
    return best_scale.squeeze(-1).to(SCALE_DTYPE), best_offset.squeeze(-1).to(SCALE_DTYPE)


def _int4_error(
    grouped: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """(Weighted) squared error per group [R, G, 1] of the codes ``round((w - offset) / scale)``."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.sub(grouped, offset).div_(safe).round_().clamp_(0, 15)
    return _sum(codes.mul_(scale).add_(offset).sub_(grouped).square_(), weights)


def quantize(
    weight: torch.Tensor,
    fmt: QuantFormat,
    search: bool = True,
    importance: torch.Tensor | None = None,
) -> QuantizedWeight:
    """``weight`` in ``fmt``; ``search`` False: round-to-nearest over each group's range;
    ``importance`` [K]: an int4 fit weighted by input channel (``quantize_int4``; int8 ignores
    it: its searched fit already meets its quality target)."""
    if fmt.kind in CODE_LIMIT:
        return quantize_int8(weight, fmt.group_size, search, fmt.kind)
    return quantize_int4(weight, fmt.group_size or weight.shape[1], search, importance)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values < 16 -> [N, K / 2]: low nibble k even, high nibble k odd."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] -> uint8 [N, K]."""
    n, half = packed.shape
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, 2 * half)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The reference: float32 [N, K], each weight ``q * scale (+ offset)`` rounded in fp32."""
    n, k = qw.shape
    group = qw.group_size
    scales = qw.scales.float().unsqueeze(-1)  # [N, K / g, 1]
    if qw.kind != INT4:
        q = qw.qdata.float().reshape(n, k // group, group)
        return (q * scales).reshape(n, k)
    assert qw.offsets is not None
    q = unpack_nibbles(qw.qdata).float().reshape(n, k // group, group)
    return (q * scales + qw.offsets.float().unsqueeze(-1)).reshape(n, k)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Rows of several weights of one format stacked (a fused projection); None if they differ."""
    first = parts[0]
    if any(p.format != first.format or p.shape[1] != first.shape[1] for p in parts):
        return None
    offsets = None
    if first.offsets is not None:
        offsets = torch.cat([p.offsets for p in parts if p.offsets is not None])
    rows = sum(p.shape[0] for p in parts)
    return QuantizedWeight(
        first.kind, (rows, first.shape[1]), first.group_size,
        torch.cat([p.qdata for p in parts]), torch.cat([p.scales for p in parts]), offsets,
    )  # fmt: skip


def _loaded(
    name: str,
    value: torch.Tensor | QuantizedWeight,
    shape: tuple[int, int],
    fmt: QuantFormat,
    owner: str,
    search: bool,
    importance: torch.Tensor | None = None,
) -> QuantizedWeight:
    """`value` as this module's weight: an already quantized one checked against the module's
    shape and format, a float one checked and quantized to the format."""
    if isinstance(value, QuantizedWeight):
        if value.shape != shape or value.format != fmt:
            raise ValueError(
                f"tensor {name!r}: {value.format.describe()} {list(value.shape)} does "
                f"not match the {owner} {fmt.describe()} {list(shape)}"
            )
        return value
    if tuple(value.shape) != shape:
        raise ValueError(
            f"tensor {name!r}: checkpoint shape {tuple(value.shape)} does not "
            f"match model shape {shape}"
        )
    return quantize(value, fmt, search=search, importance=importance)


class QuantLinear(nn.Module):
    """A linear layer (bias optional, float) over a quantized weight. Built empty with its
    format (``load`` fills it from a float tensor, quantizing, or from a ``QuantizedWeight``
    of the same format); forward runs the CPU kernel after ``prepare_for_cpu`` packed it, else
    the torch reference (dequantize, then ``F.linear``)."""

    def __init__(
        self, in_features: int, out_features: int, fmt: QuantFormat, bias: bool = False,
        name: str = "weight",
    ) -> None:  # fmt: skip
        super().__init__()
        fmt.check(name, (out_features, in_features))
        self.in_features, self.out_features = in_features, out_features
        self.format = QuantFormat(fmt.kind, fmt.group_for(in_features))
        self.name = name
        self.quantized: QuantizedWeight | None = None
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )
        self.cpu_packed: object | None = None  # worker.device.cpu_quant.PackedQuant
        # worker.device.kernels.quant_matmul.KMajorWeight (the GPU's layout; `quantized` is
        # dropped once it is set: see pack_for_device)
        self.device_packed: object | None = None
        # [in_features]: weights the int4 fit of a float weight by input channel when set
        # (``worker.loading.quantize.set_importance``, from calibration statistics)
        self.importance: torch.Tensor | None = None
        # activation-aware scales (``set_importance``): a float weight's columns are multiplied
        # by ``input_scale`` [in_features] and its rows divided by ``row_divisor``
        # [out_features] before it is quantized; the layer feeding the input divides by the
        # same scales, so the float product is unchanged and only the rounding moves
        self.input_scale: torch.Tensor | None = None
        self.row_divisor: torch.Tensor | None = None

    @staticmethod
    def from_weight(qw: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantLinear:
        layer = QuantLinear(qw.shape[1], qw.shape[0], qw.format, bias=False)
        layer.quantized = qw
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return layer

    def load(self, value: torch.Tensor | QuantizedWeight) -> None:
        """Fill the weight: a float tensor is quantized to this layer's format."""
        shape = (self.out_features, self.in_features)
        if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
            value = self._prescaled(value)
        self.quantized = _loaded(
            self.name, value, shape, self.format, "layer's", True, self.importance
        )
        self.cpu_packed = None

    def _prescaled(self, weight: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            weight = weight * self.input_scale.to(weight.device, weight.dtype)
        if self.row_divisor is not None:
            weight = weight / self.row_divisor.to(weight.device, weight.dtype)[:, None]
        return weight

    @property
    def nbytes(self) -> int:
        store = self.device_packed or self.quantized
        return 0 if store is None else int(store.nbytes)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if self.cpu_packed is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            from worker.device import cpu_quant

            out = cpu_quant.matmul(x, self.cpu_packed)
            return out if self.bias is None else out + self.bias
        if getattr(self.device_packed, "kind", None) == INT6:  # CUDA, 6-bit planes
            from worker.device.kernels.int6_matmul import int6_linear

            return int6_linear(x, self.device_packed, self.bias)  # type: ignore[arg-type]
        if self.device_packed is not None:  # worker.device.kernels.quant_matmul (CUDA)
            from worker.device.kernels.quant_matmul import quant_linear

            return quant_linear(x, self.device_packed, self.bias)  # type: ignore[arg-type]
        assert self.quantized is not None, f"{self.name}: weight not loaded"
        return F.linear(x, self.quantized.dequantize(x.dtype), self.bias)

    def gated(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """act(gate) * up of this gate_up layer's output (gate outputs first) in one fused
        path where the CUDA kernels have one for x (``quant_matmul.quant_linear_gated``),
        else None: the caller runs forward, then the activation."""
        kind = getattr(self.device_packed, "kind", None)
        if self.device_packed is None or self.bias is not None or kind == INT6:
            return None
        from worker.device.kernels.quant_matmul import quant_linear_gated

        return quant_linear_gated(x, self.device_packed, act)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format.describe()}"


class QuantEmbedding(nn.Module):
    """An int8 embedding table; a lookup dequantizes only the rows it returns. With a tied LM
    head the head is a ``QuantLinear`` over the same ``QuantizedWeight`` (one copy)."""

    def __init__(self, num_embeddings: int, dim: int, fmt: QuantFormat, dtype: torch.dtype,
                 name: str = "weight") -> None:  # fmt: skip
        super().__init__()
        fmt.check(name, (num_embeddings, dim))
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.format = QuantFormat(fmt.kind, fmt.group_for(dim))
        self.dtype = dtype
        self.name = name
        self.quantized: QuantizedWeight | None = None
        self.cpu_packed: object | None = None  # rows are gathered from it when set
        self.device_packed: object | None = None  # a K-major table shared with the LM head

    def load(self, value: torch.Tensor | QuantizedWeight) -> None:
        shape = (self.num_embeddings, self.embedding_dim)
        # 168M weights in the default model's table: too many to search for scales
        self.quantized = _loaded(self.name, value, shape, self.format, "embedding's", search=False)
        self.cpu_packed = None

    @property
    def nbytes(self) -> int:
        return 0 if self.quantized is None else self.quantized.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, dim]
        if self.device_packed is not None:
            return self.device_packed.rows(ids, self.dtype)  # type: ignore[attr-defined]
        if self.cpu_packed is not None:
            from worker.device import cpu_quant

            return cpu_quant.packed_rows(self.cpu_packed, ids).to(self.dtype)
        assert self.quantized is not None, f"{self.name}: weight not loaded"
        return self.quantized.rows(ids).dequantize(self.dtype)


def pack_for_device(
    model: nn.Module,
    dtype: torch.dtype = torch.float32,
    six_bit: bool = True,
    log: Callable[[str], None] | None = None,
) -> tuple[int, int]:
    """Every quantized linear of ``model`` (computing in ``dtype``) into the GPU kernels'
    K-major layout (``worker.device.kernels.quant_matmul.KMajorWeight``, scales in
    ``meta_dtype_for``), its canonical copy dropped as soon as it is packed, so the model never
    needs two copies of its weights (one int4 31B does not fit a 24 GB card twice); an
    embedding whose table a packed LM head shares gathers its rows from the packed table (one
    copy). int6 weights go into 6-bit planes (``worker.device.kernels.int6_matmul``), or with
    ``six_bit`` False into the int8 layout (the same codes; ``cuda_setup.six_bit_planes``
    chooses). Weights whose group the kernels cannot take stay canonical (the torch
    reference). A weight whose device has no room for its packed copy beside it
    (``_room_for_a_second_copy``) is packed from a host copy, its device copy freed first
    (`log` says how many). Returns (packed, left canonical). Imports Triton."""
    from worker.device.kernels.int6_matmul import SixBitWeight
    from worker.device.kernels.quant_matmul import KMajorWeight, meta_dtype_for

    users: dict[int, list[QuantLinear | QuantEmbedding]] = {}  # modules sharing a weight
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and module.quantized is not None:
            users.setdefault(id(module.quantized), []).append(module)
    packed = left = staged = 0
    for sharing in users.values():
        qw = sharing[0].quantized
        assert qw is not None
        if not any(isinstance(m, QuantLinear) for m in sharing):
            continue  # an embedding alone: rows gathered from its canonical table
        device_packed: KMajorWeight | SixBitWeight
        if qw.kind == INT6 and not six_bit:  # the int8 kernels over the same codes
            qw = QuantizedWeight(INT8, qw.shape, qw.group_size, qw.qdata, qw.scales)
        if qw.kind == INT6 and SixBitWeight.supports(qw):
            device_packed = SixBitWeight.pack(qw)
        elif qw.kind != INT6 and KMajorWeight.supports(qw):
            meta = meta_dtype_for(qw.kind, dtype)
            if _room_for_a_second_copy(qw):
                device_packed = KMajorWeight.pack(qw, meta)
            else:  # its canonical copy leaves the device first (a 24 GB card's tied table)
                device, qw = qw.device, qw.to("cpu")
                for module in sharing:
                    module.quantized = None
                torch.cuda.empty_cache()
                device_packed = KMajorWeight.pack(qw, meta, device=device)
                staged += 1
        else:
            left += 1
            continue
        for module in sharing:
            module.device_packed = device_packed
            module.quantized = None  # the canonical copy goes before the next weight packs
        del qw
        packed += 1
    if staged and log is not None:
        log(f"cuda_setup: {staged} quantized weights packed from a host copy: the device had "
            "no room for a second copy of each")  # fmt: skip
    return packed, left


PACK_MARGIN_BYTES = 256 << 20
"""Beside a weight's packed copy, what its packing's row chunks may take."""


def _room_for_a_second_copy(qw: QuantizedWeight) -> bool:
    """Whether `qw`'s device can hold its packed copy beside it (``memory.free_bytes``, after
    ``empty_cache`` where it looks short); where not, ``pack_for_device`` packs it from a host
    copy. The 31B's tied 1.5 GB table, packed first under a 24 GB card's limit, ran out in one
    of three starts (session 47), the load's free pages still reserved. Always on the CPU."""
    if qw.device.type != "cuda":
        return True
    from worker.device import memory

    need = qw.nbytes + PACK_MARGIN_BYTES
    if memory.free_bytes(qw.device) >= need:
        return True
    torch.cuda.empty_cache()  # pages the load left free go back first
    return memory.free_bytes(qw.device) >= need
