"""Weight-only quantized formats and the layers holding them (``QuantLinear``, ``QuantEmbedding``).

Two formats, both group-wise along the input dimension K of a weight [N, K]:

    int8  symmetric:   w[n, k] = q[n, k] * scale[n, k // g]             q int8 in [-127, 127]
    int4  asymmetric:  w[n, k] = q[n, k] * scale[n, k // g] + offset[n, k // g]   q in [0, 15]

``g`` (the group size) divides K; ``g == K`` is one scale per output channel. Scales and
offsets are fp16 (a quarter of a byte per weight at int4 g32). The int4 offset is the group's
zero point as a float (offset = -zero * scale), so a GGUF Q4_K block (``d * sc * q - dmin * m``)
repacks into it up to the fp16 rounding of the two products.

The canonical layout, ``QuantizedWeight``, is row-major: int8 ``qdata`` [N, K]; int4 ``qdata``
uint8 [N, K / 2], low nibble the even k. Device code repacks it for its kernels (the CPU:
``worker.device.cpu_quant``); the torch reference here (``dequantize``) is what every kernel is
tested against. Norms, biases and other vectors are never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INT8, INT4 = "int8", "int4"
KINDS = (INT8, INT4)
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantFormat:
    """A weight's storage format: ``kind`` int8 or int4 and ``group_size`` (0: one group per
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
    qdata: torch.Tensor  # int8 [N, K] | uint8 [N, K / 2]
    scales: torch.Tensor  # fp16 [N, K / g]
    offsets: torch.Tensor | None = None  # fp16 [N, K / g], int4 only

    @property
    def format(self) -> QuantFormat:
        return QuantFormat(self.kind, self.group_size)

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


def quantize_int8(weight: torch.Tensor, group_size: int = 0) -> QuantizedWeight:
    """Symmetric int8, scale = amax / 127 per group (``group_size`` 0: per output channel)."""
    n, k = weight.shape
    group = group_size or k
    QuantFormat(INT8, group).check("weight", (n, k))
    grouped = _groups(weight, group)
    scales = (grouped.abs().amax(dim=-1) / 127.0).to(SCALE_DTYPE)  # [N, K / g]
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float().unsqueeze(-1)
    q = torch.round(grouped / safe).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight(INT8, (n, k), group, q, scales)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 over each group's [min, max]: scale = (max - min) / 15, offset = min."""
    n, k = weight.shape
    QuantFormat(INT4, group_size).check("weight", (n, k))
    grouped = _groups(weight, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15.0).to(SCALE_DTYPE)
    offsets = low.to(SCALE_DTYPE)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float().unsqueeze(-1)
    q = torch.round((grouped - offsets.float().unsqueeze(-1)) / safe).clamp_(0, 15)
    return QuantizedWeight(INT4, (n, k), group_size, pack_nibbles(q.to(torch.uint8).reshape(n, k)),
                           scales, offsets)  # fmt: skip


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    if fmt.kind == INT8:
        return quantize_int8(weight, fmt.group_size)
    return quantize_int4(weight, fmt.group_size or weight.shape[1])


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
    if qw.kind == INT8:
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
        if isinstance(value, QuantizedWeight):
            if value.shape != shape or value.format != self.format:
                raise ValueError(
                    f"tensor {self.name!r}: {value.format.describe()} {list(value.shape)} does "
                    f"not match the layer's {self.format.describe()} {list(shape)}"
                )
            self.quantized = value
        else:
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"tensor {self.name!r}: checkpoint shape {tuple(value.shape)} does not "
                    f"match model shape {shape}"
                )
            self.quantized = quantize(value, self.format)
        self.cpu_packed = None

    @property
    def nbytes(self) -> int:
        return 0 if self.quantized is None else self.quantized.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if self.cpu_packed is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            from worker.device import cpu_quant

            out = cpu_quant.matmul(x, self.cpu_packed)
            return out if self.bias is None else out + self.bias
        assert self.quantized is not None, f"{self.name}: weight not loaded"
        return F.linear(x, self.quantized.dequantize(x.dtype), self.bias)

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

    def load(self, value: torch.Tensor | QuantizedWeight) -> None:
        shape = (self.num_embeddings, self.embedding_dim)
        if isinstance(value, QuantizedWeight):
            if value.shape != shape or value.format != self.format:
                raise ValueError(
                    f"tensor {self.name!r}: {value.format.describe()} {list(value.shape)} does "
                    f"not match the embedding's {self.format.describe()} {list(shape)}"
                )
            self.quantized = value
        else:
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"tensor {self.name!r}: checkpoint shape {tuple(value.shape)} does not "
                    f"match model shape {shape}"
                )
            self.quantized = quantize(value, self.format)
        self.cpu_packed = None

    @property
    def nbytes(self) -> int:
        return 0 if self.quantized is None else self.quantized.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, dim]
        if self.cpu_packed is not None:
            from worker.device import cpu_quant

            return cpu_quant.packed_rows(self.cpu_packed, ids).to(self.dtype)
        assert self.quantized is not None, f"{self.name}: weight not loaded"
        return self.quantized.rows(ids).dequantize(self.dtype)
