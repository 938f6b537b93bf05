"""Quantized MoE experts (``--quantize int8|int4`` on qwen3_5_moe): ``mlp.experts`` with each
expert's two matrices stored group-wise quantized, K-major per expert.

    gate_up_proj [E, 2I, H] -> words int32 [E, H / P, 2I], scales (offsets) fp16 [E, H / g, 2I]
    down_proj    [E, H, I]  -> words int32 [E, I / P, H],  scales (offsets) fp16 [E, I / g, H]

Each expert's [N, K] matrix is quantized as ``worker.layers.quant.quantize`` quantizes a
linear's weight (groups of g along K; int4 asymmetric, int8 symmetric) and kept in the K-major
layout of ``worker.device.kernels.quant_matmul.KMajorWeight`` (word (w, n) holds the P codes of
k = P*w .. P*w + P - 1, code i at bits (32 / P) * i; int4 P = 8, int8 P = 4 signed bytes),
stacked over the experts. One layout on both devices, so nothing is repacked after loading:
the CPU path dequantizes only the experts a step hit (``expert_weight``, equal to
``quant.dequantize`` of the canonical form bit for bit); the Triton grouped GEMMs
(``worker.device.kernels.moe_quant``) dequantize each weight tile in registers.

The stores are non-persistent buffers: ``to_empty`` gives them storage (the quantized size,
never a float one) and the checkpoint loader does not see them as parameters. ``load`` takes
a fused float tensor ([E, N, K]) and quantizes it a few experts at a time; ``load_rows`` one
expert's rows (a per-expert checkpoint tensor: gate and up are row ranges of ``gate_up_proj``,
and quantization is per row, so quantizing them apart equals quantizing them together).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.layers.quant import INT4, QuantFormat, QuantizedWeight, quantize, unpack_nibbles

MATRICES = ("gate_up_proj", "down_proj")
LOAD_EXPERTS = 16  # experts quantized at a time by ``load``: bounds the temporaries


def per_word(kind: str) -> int:
    return 8 if kind == INT4 else 4


@dataclass(frozen=True)
class ExpertMatrix:
    """One stacked matrix's stores (views of the module's buffers), what the kernels take."""

    kind: str
    shape: tuple[int, int, int]  # [E, N, K]
    group_size: int
    words: torch.Tensor  # int32 [E, K / P, N]
    scales: torch.Tensor  # fp16 [E, K / g, N]
    offsets: torch.Tensor | None  # fp16 [E, K / g, N], int4 only


def kmajor_words(qw: QuantizedWeight) -> torch.Tensor:
    """A canonical [R, K] quantized weight's codes -> int32 words [R, K / P] (row-major; the
    caller transposes each expert's block)."""
    rows, k = qw.shape
    count = per_word(qw.kind)
    if qw.kind == INT4:
        codes, bits = unpack_nibbles(qw.qdata).to(torch.int32), 4
    else:
        codes, bits = qw.qdata.to(torch.int32) & 0xFF, 8
    codes = codes.view(rows, k // count, count)
    words = torch.zeros(codes.shape[:2], dtype=torch.int32, device=codes.device)
    for position in range(count):
        words |= codes[:, :, position] << (bits * position)  # int32 wraps: the sign bit is data
    return words


def unpack_words(words: torch.Tensor, kind: str) -> torch.Tensor:
    """int32 words [K / P, N] -> float32 codes [K, N] (int8 codes signed)."""
    count = per_word(kind)
    bits = 32 // count
    shifts = torch.arange(count, device=words.device, dtype=torch.int32) * bits
    if kind == INT4:
        codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF
    else:  # each byte shifted to the top, then arithmetic-shifted down: its sign
        codes = (words.unsqueeze(1) << (24 - shifts).view(1, -1, 1)) >> 24
    return codes.reshape(-1, words.shape[1]).float()


# Whether a long step (a prefill chunk) may dequantize a layer's hit experts into a float
# scratch, the faster prefill (``worker.device.kernels.moe_quant.use_dequant``): 1.5 GiB a
# layer for the 35B-A3B model in bf16, which a 24 GB card may not have beside the weights and
# a session (session 30: the Q4_K_M file kept, one 32k slot, ran out asking for it). The
# worker turns it off when it does not fit (worker/main.py ``_fit_expert_scratch``); the
# quantized grouped GEMMs then dequantize tiles in registers.
DEQUANT_SCRATCH = {"allowed": True}


def dequant_scratch_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The largest float scratch one layer's experts dequantize into (every expert hit)."""
    size = torch.empty((), dtype=dtype).element_size()
    return max(
        (
            sum(m.num_experts * n * k * size for n, k in m.shapes.values())
            for m in model.modules()
            if isinstance(m, QuantExperts)
        ),
        default=0,
    )


class QuantExperts(nn.Module):
    """``mlp.experts`` quantized: the two stacked matrices of ``FusedExperts`` in ``fmt``."""

    def __init__(
        self, num_experts: int, hidden: int, inner: int, fmt: QuantFormat, name: str = "experts"
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inner = num_experts, hidden, inner
        self.kind = fmt.kind
        self.name = name
        self.shapes = {"gate_up_proj": (2 * inner, hidden), "down_proj": (hidden, inner)}
        self.groups: dict[str, int] = {}
        count = per_word(fmt.kind)
        for matrix, (n, k) in self.shapes.items():
            fmt.check(f"{name}.{matrix}", (n, k))
            if k % count:
                raise ValueError(
                    f"tensor {name}.{matrix!r}: input dimension {k} is not a multiple of "
                    f"{count} ({fmt.kind} experts pack {count} codes per word)"
                )
            group = fmt.group_for(k)
            self.groups[matrix] = group
            self.register_buffer(
                f"{matrix}_words",
                torch.zeros(num_experts, k // count, n, dtype=torch.int32),
                persistent=False,
            )
            meta = (num_experts, k // group, n)
            self.register_buffer(
                f"{matrix}_scales", torch.zeros(meta, dtype=torch.float16), persistent=False
            )
            offsets = torch.zeros(meta, dtype=torch.float16) if fmt.kind == INT4 else None
            self.register_buffer(f"{matrix}_offsets", offsets, persistent=False)

    def format(self, matrix: str) -> QuantFormat:
        return QuantFormat(self.kind, self.groups[matrix])

    def matrix(self, matrix: str) -> ExpertMatrix:
        n, k = self.shapes[matrix]
        return ExpertMatrix(
            self.kind, (self.num_experts, n, k), self.groups[matrix],
            getattr(self, f"{matrix}_words"), getattr(self, f"{matrix}_scales"),
            getattr(self, f"{matrix}_offsets"),
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    @torch.no_grad()
    def load(self, matrix: str, value: torch.Tensor) -> None:
        """A fused float tensor [E, N, K] (the HF layout), quantized LOAD_EXPERTS at a time."""
        n, k = self.shapes[matrix]
        if tuple(value.shape) != (self.num_experts, n, k):
            raise ValueError(
                f"tensor {self.name}.{matrix!r}: checkpoint shape {tuple(value.shape)} does "
                f"not match model shape {(self.num_experts, n, k)}"
            )
        for first in range(0, self.num_experts, LOAD_EXPERTS):
            last = min(first + LOAD_EXPERTS, self.num_experts)
            self._store(matrix, slice(first, last), slice(0, n), value[first:last])

    @torch.no_grad()
    def load_rows(
        self, matrix: str, expert: int, first_row: int, value: torch.Tensor | QuantizedWeight
    ) -> None:
        """Rows [first_row, first_row + R) of one expert's matrix from a float [R, K], or from
        a QuantizedWeight (a GGUF's blocks, repacked): stored as it is when it has this
        matrix's format, else dequantized and quantized again."""
        n, k = self.shapes[matrix]
        rows = value.shape[0]
        if len(value.shape) != 2 or value.shape[1] != k or first_row + rows > n:
            raise ValueError(
                f"tensor {self.name}.{expert}.{matrix!r}: shape {tuple(value.shape)} does not "
                f"fit rows {first_row}..{first_row + rows} of [{n}, {k}]"
            )
        experts, lines = slice(expert, expert + 1), slice(first_row, first_row + rows)
        if isinstance(value, QuantizedWeight):
            if value.format == self.format(matrix):
                self._write(matrix, experts, lines, value.to(self.matrix(matrix).words.device))
                return
            value = value.dequantize()
        self._store(matrix, experts, lines, value.unsqueeze(0), search=True)

    def _store(
        self, matrix: str, experts: slice, rows: slice, value: torch.Tensor, search: bool = True
    ) -> None:
        """value float [e, r, K] -> the stores of experts ``experts``, rows ``rows``."""
        e, r, k = value.shape
        value = value.to(self.matrix(matrix).words.device)
        self._write(matrix, experts, rows, quantize(value.reshape(e * r, k), self.format(matrix),
                                                    search=search))  # fmt: skip

    def _write(self, matrix: str, experts: slice, rows: slice, qw: QuantizedWeight) -> None:
        """A QuantizedWeight [e * r, K] in this matrix's format -> experts ``experts``, rows
        ``rows`` of the stores."""
        store = self.matrix(matrix)
        count, r = experts.stop - experts.start, rows.stop - rows.start
        words = kmajor_words(qw).view(count, r, -1)  # [e, r, K / P]
        store.words[experts, :, rows] = words.transpose(1, 2)
        store.scales[experts, :, rows] = qw.scales.view(count, r, -1).transpose(1, 2)
        if store.offsets is not None:
            assert qw.offsets is not None
            store.offsets[experts, :, rows] = qw.offsets.view(count, r, -1).transpose(1, 2)

    @torch.no_grad()
    def draw_random(self, std: float, generator: torch.Generator, dtype: torch.dtype) -> None:
        """``--random-weights``: each expert's matrices N(0, std) in ``dtype``, quantized to
        nearest (no scale search), LOAD_EXPERTS experts at a time (one at a time made the
        35B-A3B shape's 10,240 expert matrices a start-up cost of their own)."""
        device = self.matrix("gate_up_proj").words.device
        for matrix, (n, k) in self.shapes.items():
            for first in range(0, self.num_experts, LOAD_EXPERTS):
                last = min(first + LOAD_EXPERTS, self.num_experts)
                weight = torch.empty((last - first, n, k), device=device, dtype=dtype)
                weight.normal_(0.0, std, generator=generator)
                self._store(matrix, slice(first, last), slice(0, n), weight, search=False)

    def expert_weight(self, matrix: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's dequantized matrix [N, K] in ``dtype`` (``code * scale (+ offset)`` in
        fp32, as ``quant.dequantize``); the CPU path's per-expert weight."""
        store = self.matrix(matrix)
        group = store.group_size
        codes = unpack_words(store.words[expert], self.kind)  # [K, N]
        weight = codes * store.scales[expert].float().repeat_interleave(group, dim=0)
        if store.offsets is not None:
            weight = weight + store.offsets[expert].float().repeat_interleave(group, dim=0)
        return weight.t().contiguous().to(dtype)  # [N, K] as F.linear reads a float weight

    def extra_repr(self) -> str:
        return (
            f"{self.num_experts} experts, {self.hidden} -> {self.inner}, "
            f"{self.format('gate_up_proj').describe()}"
        )
