"""What one tensor-parallel rank holds: its config, its slice of every weight, its layers.

Megatron's layout, on the families' own modules (nothing is rebuilt):

- column-parallel (output rows split): q/k/v, gate/up. Rank r keeps whole heads
  ``[r * H/tp, (r+1) * H/tp)`` and the KV heads they read: ``KVH/tp`` of them, or (fewer KV
  heads than ranks) the one KV head of its query group, replicated on ``tp/KVH`` ranks. The
  merged projections (``fuse_projections``) are built after loading, from the rank's slices,
  so each merged matrix is q, k, v of the rank's own heads.
- row-parallel (input columns split): o_proj, down_proj; their outputs are partial sums,
  all-reduced (``RowParallel``). A bias is added once: rank 0 keeps it, the others hold zeros.
- vocabulary-parallel: the embedding and the LM head keep rows ``[r * Vl, (r+1) * Vl)``,
  ``Vl = ceil(V / tp)`` (the last rank's tail padded with zero rows). A lookup is the owner's
  row, zeros elsewhere, all-reduced (one rank contributes: exact); the head's logits are
  all-gathered and trimmed to V (every rank gets every logit, bit for bit).
- everything else (norms, q/k norms, layer scalars, rotary) is replicated.

Quantized weights (``QuantizedWeight``, group-wise along K) split by rows freely and by
columns only on group boundaries: a row-parallel rank's K slice must be a whole number of
groups, else loading fails naming the tensor.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from worker.layers.quant import QuantizedWeight
from worker.models.config import ModelConfig

SUPPORTED_FAMILIES = ("llama", "gemma3", "gemma4", "qwen3_5_moe")
_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.(self_attn|mlp|linear_attn)\.(.+)$")
_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")  # children whose outputs are all-reduced


def _kv_heads(num_kv_heads: int, tp: int, rank: int, where: str) -> tuple[int, int]:
    """(first KV head, count) of `rank`: a slice, or one head replicated across ranks."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"{where}: {num_kv_heads} KV heads do not split across {tp} ranks")
        count = num_kv_heads // tp
        return rank * count, count
    if tp % num_kv_heads:
        raise ValueError(f"{where}: {num_kv_heads} KV heads cannot be replicated on {tp} ranks")
    return rank * num_kv_heads // tp, 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank` of `tp`: the full config and the slices it implies."""

    full: ModelConfig
    tp: int
    rank: int

    def __post_init__(self) -> None:
        cfg, tp = self.full, self.tp
        if cfg.family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"--tensor-parallel: {cfg.architecture} ({cfg.family}) is not split yet; "
                f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if cfg.num_attention_heads % tp:
            raise ValueError(f"{cfg.num_attention_heads} attention heads do not split across {tp}")
        if cfg.intermediate_size % tp:
            raise ValueError(
                f"intermediate size {cfg.intermediate_size} does not split across {tp}"
            )
        for i, spec in enumerate(cfg.layers):
            _kv_heads(spec.num_kv_heads, tp, self.rank, f"layer {i}")
        sizes = {}
        if cfg.deltanet is not None:
            sizes["DeltaNet key heads"] = cfg.deltanet.num_key_heads
            sizes["DeltaNet value heads"] = cfg.deltanet.num_value_heads
        if cfg.moe is not None:
            sizes["expert intermediate size"] = cfg.moe.expert_intermediate_size
            sizes["shared expert intermediate size"] = cfg.moe.shared_intermediate_size
        for what, size in sizes.items():
            if size % tp:
                raise ValueError(f"{what} {size} does not split across {tp} ranks")

    @property
    def heads(self) -> int:
        return self.full.num_attention_heads // self.tp

    @property
    def inner(self) -> int:
        return self.full.intermediate_size // self.tp

    @property
    def vocab(self) -> int:
        """Rows of the embedding and the head on every rank (padded on the last)."""
        return -(-self.full.vocab_size // self.tp)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def config(self) -> ModelConfig:
        """The config the rank's model is built from (its heads, its MLP, its vocab rows)."""
        layers = tuple(
            dataclasses.replace(
                spec, num_kv_heads=_kv_heads(spec.num_kv_heads, self.tp, self.rank, "")[1]
            )
            for spec in self.full.layers
        )
        deltanet, moe = self.full.deltanet, self.full.moe
        if deltanet is not None:
            deltanet = dataclasses.replace(
                deltanet,
                num_key_heads=deltanet.num_key_heads // self.tp,
                num_value_heads=deltanet.num_value_heads // self.tp,
            )
        if moe is not None:  # every expert keeps a 1/tp slice of its intermediate size
            moe = dataclasses.replace(
                moe,
                expert_intermediate_size=moe.expert_intermediate_size // self.tp,
                shared_intermediate_size=moe.shared_intermediate_size // self.tp,
            )
        return dataclasses.replace(
            self.full,
            num_attention_heads=self.heads,
            intermediate_size=self.inner,
            vocab_size=self.vocab,
            layers=layers,
            deltanet=deltanet,
            moe=moe,
        )

    # -- slicing ---------------------------------------------------------------------------

    def tensors(
        self, pairs: Iterable[tuple[str, Any]], device: torch.device | None = None
    ) -> Iterator[tuple[str, Any]]:
        """The rank's slice of each (HF name, tensor) pair; replicated ones pass unchanged."""
        for name, value in pairs:
            sliced = self.slice(name, value)
            if device is not None and sliced.device != device:
                sliced = sliced.to(device)
            yield name, sliced

    def slice(self, name: str, value: Any) -> Any:
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return _rows(value, self.vocab_start, self.vocab, pad=True)
        match = _LAYER_TENSOR.search(name)
        if match is None:
            return value
        layer, block, rest = int(match.group(1)), match.group(2), match.group(3)
        parts = rest.split(".")
        if block == "self_attn":
            return self._attention(layer, parts[0], parts[-1], value, name)
        if block == "linear_attn":
            return self._deltanet(parts[0], value, name)
        if parts[0] == "experts":
            return self._experts(parts, value, name)
        if parts[0] == "shared_expert":
            assert self.full.moe is not None
            inner = self.full.moe.shared_intermediate_size // self.tp
            return self._mlp(parts[1], parts[-1], inner, value, name)
        if parts[0] in ("gate_proj", "up_proj", "down_proj"):
            return self._mlp(parts[0], parts[-1], self.inner, value, name)
        return value  # norms, the MoE router and its shared-expert gate

    def _attention(self, layer: int, proj: str, kind: str, value: Any, name: str) -> Any:
        d = self.full.layers[layer].head_dim
        if proj == "q_proj":  # qwen3_5_moe: each head's query, then its gate
            per_head = d * (2 if self.full.family == "qwen3_5_moe" else 1)
            return _rows(value, self.rank * self.heads * per_head, self.heads * per_head)
        if proj in ("k_proj", "v_proj"):
            first, count = _kv_heads(self.full.layers[layer].num_kv_heads, self.tp, self.rank, name)
            return _rows(value, first * d, count * d)
        if proj == "o_proj":
            return self._row_parallel(kind, value, self.heads * d, name)
        return value  # q/k norms

    def _mlp(self, proj: str, kind: str, inner: int, value: Any, name: str) -> Any:
        if proj in ("gate_proj", "up_proj"):
            return _rows(value, self.rank * inner, inner)
        if proj == "down_proj":
            return self._row_parallel(kind, value, inner, name)
        return value

    def _row_parallel(self, kind: str, value: Any, width: int, name: str) -> Any:
        if kind == "bias":  # added once, after the all-reduce's sum
            return value if self.rank == 0 else torch.zeros_like(value)
        return _columns(value, self.rank * width, width, name)

    def _experts(self, parts: list[str], value: Any, name: str) -> Any:
        """Every expert keeps the rank's slice of its intermediate size: fused
        ``gate_up_proj`` [E, 2I, H] (gate rows, then up), ``down_proj`` [E, H, I], or one
        expert's ``<e>.gate_proj.weight`` [I, H] ..."""
        assert self.full.moe is not None
        full = self.full.moe.expert_intermediate_size
        inner = full // self.tp
        start = self.rank * inner
        if parts[1] == "gate_up_proj":
            gate, up = (
                value[:, start : start + inner],
                value[:, full + start : full + start + inner],
            )
            return torch.cat([gate, up], dim=1)
        if parts[1] == "down_proj":
            return value[:, :, start : start + inner].contiguous()
        return self._mlp(parts[2], parts[-1], inner, value, name)  # one expert's tensor

    def _deltanet(self, part: str, value: Any, name: str) -> Any:
        """The rank's key heads and the value heads that read them (consecutive groups)."""
        spec = self.full.deltanet
        assert spec is not None
        hk, hv = spec.num_key_heads // self.tp, spec.num_value_heads // self.tp
        dk, dv = spec.key_head_dim, spec.value_head_dim
        key_dim = spec.num_key_heads * dk
        q_rows = (self.rank * hk * dk, hk * dk)
        v_rows = (self.rank * hv * dv, hv * dv)
        if part in ("in_proj_qkv", "conv1d"):  # channels: q keys, k keys, values
            starts = (q_rows[0], key_dim + q_rows[0], 2 * key_dim + v_rows[0])
            counts = (q_rows[1], q_rows[1], v_rows[1])
            ids = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, counts, strict=True)])
            return value.rows(ids) if isinstance(value, QuantizedWeight) else value[ids]
        if part == "in_proj_z":
            return _rows(value, *v_rows)
        if part in ("in_proj_b", "in_proj_a", "dt_bias", "A_log"):
            return _rows(value, self.rank * hv, hv)
        if part == "out_proj":
            return _columns(value, v_rows[0], v_rows[1], name)
        return value  # the gated norm (per head dim)


def _rows(value: Any, start: int, count: int, pad: bool = False) -> Any:
    """Rows [start, start + count) of a [N, ...] tensor or QuantizedWeight; with `pad`, rows
    past N are zeros (a zero quantized row: zero codes, scales and offsets)."""
    if isinstance(value, QuantizedWeight):
        n = value.shape[0]
        end = min(start + count, n)
        offsets = None if value.offsets is None else _pad(value.offsets[start:end], count)
        return QuantizedWeight(
            value.kind,
            (count, value.shape[1]),
            value.group_size,
            _pad(value.qdata[start:end], count),
            _pad(value.scales[start:end], count),
            offsets,
        )
    end = min(start + count, value.shape[0])
    part = value[start:end]
    return _pad(part, count) if pad else part.contiguous()


def _pad(part: torch.Tensor, count: int) -> torch.Tensor:
    if part.shape[0] == count:
        return part.contiguous()
    filler = part.new_zeros((count - part.shape[0], *part.shape[1:]))
    return torch.cat([part, filler])


def _columns(value: Any, start: int, count: int, name: str) -> Any:
    """Columns [start, start + count) of a [N, K] weight: K is split on group boundaries."""
    if not isinstance(value, QuantizedWeight):
        return value[:, start : start + count].contiguous()
    group = value.group_size
    if start % group or count % group or group % 2:
        raise ValueError(
            f"{name}: a rank's {count} input columns from {start} are not whole groups of "
            f"{group} (quantized weights split on group boundaries only)"
        )
    per_byte = 2 if value.qdata.shape[1] * 2 == value.shape[1] else 1  # int4: two codes a byte
    qdata = value.qdata[:, start // per_byte : (start + count) // per_byte].contiguous()
    scales = value.scales[:, start // group : (start + count) // group].contiguous()
    offsets = None
    if value.offsets is not None:
        offsets = value.offsets[:, start // group : (start + count) // group].contiguous()
    return QuantizedWeight(
        value.kind, (value.shape[0], count), value.group_size, qdata, scales, offsets
    )


# -- the rank's modules ---------------------------------------------------------------------


class RowParallel(nn.Module):
    """A row-parallel linear: the rank's partial product, summed over the group in place.

    ``inner`` stays a plain child, so the post-load steps (CPU packing, quantized kernels)
    replace it like any other linear."""

    def __init__(self, inner: nn.Module, group: Any) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out: torch.Tensor = self.inner(x)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallel:
    """The embedding lookup and the LM head over the rank's vocabulary rows."""

    def __init__(self, start: int, rows: int, vocab: int, tp: int, group: Any) -> None:
        self.start, self.rows, self.vocab, self.tp, self.group = start, rows, vocab, tp, group

    def embed(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (global) -> [T, hidden]: each id's row from the rank that owns it."""
        import torch.distributed as dist

        local = ids - self.start
        owned = (local >= 0) & (local < self.rows)
        x: torch.Tensor = table(torch.where(owned, local, torch.zeros_like(local)))
        x = x * owned.unsqueeze(-1).to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[B, Vl] on each rank -> [B, V] on every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab]


def parallelize(model: nn.Module, shard: Shard, group: Any) -> None:
    """Install the group's collectives in a loaded rank model: o_proj, down_proj and
    out_proj become ``RowParallel``, a sparse MoE block as a whole (its routed experts' and
    shared expert's partial sums, one all-reduce), and the model's ``tensor_parallel`` hook
    does the vocabulary split."""
    from worker.layers.moe import SparseMoE

    inside_moe = {
        id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.modules()
    }
    for parent in list(model.modules()):
        if id(parent) in inside_moe or isinstance(parent, RowParallel):
            continue
        for name, child in list(parent.named_children()):
            if name in _ROW_PARALLEL or isinstance(child, SparseMoE):
                setattr(parent, name, RowParallel(child, group))
    model.tensor_parallel = VocabParallel(  # type: ignore[assignment]
        shard.vocab_start, shard.vocab, shard.full.vocab_size, shard.tp, group
    )
