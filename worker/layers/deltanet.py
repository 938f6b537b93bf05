"""Gated DeltaNet: the linear-attention layer of Qwen3.5 (``linear_attention`` layers).

Per value head h, a recurrent state S [Dk, Dv] replaces the KV cache. Each token t:

    S  <- exp(g_t) * S                          g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0
    S  <- S + k_t (beta_t * (v_t - S^T k_t))^T  beta_t = sigmoid(b_t): the delta rule
    o_t = S^T q_t                               q, k L2-normalised, q scaled by Dk^-0.5

q, k and v come out of a depthwise causal conv1d (kernel K, SiLU) over the projection
``in_proj_qkv``, so a sequence also carries the conv's last K - 1 inputs. The output goes through
an RMS norm gated by silu(z) (``in_proj_z``), then ``out_proj``. Key heads are shared by
``num_value_heads // num_key_heads`` consecutive value heads.

Two forms of the same recurrence, both plain torch (any device): ``chunked_gated_delta_rule``
for prefill (chunks of 64 tokens solved with one triangular system each, the state carried from
chunk to chunk) and ``recurrent_gated_delta_rule`` for a batch of decoding sequences (one token
each). The state is float32 whatever the model's dtype.

On CUDA (``use_triton``): decode rows go through two Triton kernels that update each row's conv
and recurrent state in place in its slot (``worker.device.kernels.deltanet_decode``: no gather
or scatter of states, padding rows with slot -1 write nothing, so the step can be captured in a
CUDA graph); a bf16/fp16 prefill goes through flash-linear-attention's
``chunk_gated_delta_rule`` (the ``fla-core`` package) when it imports, else the torch form. An
fp32 model keeps the torch prefill (the reference the tests compare against). The conv of a
prefill chunk is ``F.conv1d`` on every device. TOKENPIPE_NO_FLA=1 turns fla off.

States inside a prefill step (a slot's snapshot, a prefix-pool state at a block end) used to
split the sequence there: with fla each piece is a call of ~1 ms of host time a layer, and a
2,048-token prompt's state at its last block end (1,792) took the H200's bf16 prefill of the
35B-A3B shape from 23k to 11k tok/s. Both forms carry the state from one 64-token chunk to the
next, so a state a multiple of 64 rows into the step comes out of the pass itself: the torch
form hands it out, and fla is called as its stages (``fla_stages``: the same kernels on the
same inputs) with the state pass run again over the rows before the point (float32, the state
a split there would carry). Elsewhere the sequence is still split; a one-token piece (a named
prompt's snapshot before its last token) takes the one-token recurrence.

A tensor-only plan (``worker.device.decode_graphs.FusedDecodePlan``: ``plan.slots`` [T] int64,
one new token per row) is the decode graphs' step: every row decodes.

Hidden states are flattened [T, hidden] with the sequences of one step concatenated; the state of
each sequence lives in its slot of a ``DeltaNetLayerCache`` (``worker.layers.hybrid_cache``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.device.kernels.attention import use_triton
from worker.layers.attention import AttentionPlan
from worker.layers.blocks import LLAMA_NORM, RMSNorm, _concat_linears
from worker.layers.hybrid_cache import DeltaNetLayerCache
from worker.models.config import ModelConfig

CHUNK = 64  # tokens per chunk of the chunked form
FUSED_PROJECTION_DEVICES = ("cuda",)  # where fuse_projections merges the input matmuls


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x², -1) + eps), as flash-linear-attention normalises q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of one sequence continuing after ``state``.

    x [n, C]; state [C, K - 1] (the previous inputs, oldest first; None: zeros); weight [C, K]
    -> (out [n, C], new state [C, K - 1]).
    """
    n, channels = x.shape
    kernel = weight.shape[-1]
    history = (
        torch.zeros(channels, kernel - 1, dtype=x.dtype, device=x.device)
        if state is None
        else state.to(x.dtype)
    )
    padded = torch.cat([history, x.T], dim=-1)  # [C, K - 1 + n]
    out = F.conv1d(padded[None].to(weight.dtype), weight[:, None, :], groups=channels)[0]
    return F.silu(out).T.to(x.dtype), padded[:, n:]  # [n, C], [C, K - 1]


def conv_state_after(
    x: torch.Tensor, state: torch.Tensor | None, rows: int, kernel: int
) -> torch.Tensor:
    """The conv state [C, K - 1] after the first ``rows`` tokens of x [n, C] that continue
    ``state`` (None: zeros): what ``causal_conv1d`` of those rows alone returns."""
    keep = kernel - 1
    if rows >= keep:
        return x[rows - keep : rows].T
    history = torch.zeros_like(x[:keep].T) if state is None else state.to(x.dtype)
    return torch.cat([history[:, rows:], x[:rows].T], dim=-1)


def causal_conv1d_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: x [B, C]; state [B, C, K - 1]; weight [C, K]
    -> (out [B, C], new state [B, C, K - 1])."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    out = F.conv1d(window.to(weight.dtype), weight[:, None, :], groups=x.shape[1])[:, :, 0]
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = CHUNK,
    states_at: Sequence[int] = (),
    states: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, ``chunk`` tokens at a time.

    q, k [H, n, Dk] (normalised, q scaled); v [H, n, Dv]; g, beta [H, n]; state [H, Dk, Dv] or
    None (zeros); all float32 -> (out [H, n, Dv], final state [H, Dk, Dv]). ``states_at``
    (multiples of ``chunk`` in (0, n)): the state after that many tokens is appended to
    ``states`` too, the one a prefill split there would carry.

    Within a chunk, with G_i = exp(sum_{j <= i} g_j) (from the chunk's start) and S0 the state
    before it, the updates u_i = beta_i (v_i - S_{i-1}^T k_i) solve the unit lower triangular
    system (I + A) U = beta V - beta G K S0, A_ij = beta_i (G_i / G_j) k_i.k_j for j < i; then
    o_i = G_i S0^T q_i + sum_{j <= i} (G_i / G_j) (q_i.k_j) u_j and the state after the chunk is
    G_last S0 + sum_j (G_last / G_j) k_j u_j^T. Padding tokens (g = 0, beta = 0) change nothing.
    """
    heads, n, dk = k.shape
    dv = v.shape[-1]
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    chunks = (n + pad) // chunk
    # [H, C, L, D] / [H, C, L]
    q, k, v = (x.reshape(heads, chunks, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, chunks, chunk), beta.reshape(heads, chunks, chunk)

    log_decay = g.cumsum(dim=-1)  # [H, C, L]: log G_i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # G_i / G_j for j <= i, 0 above the diagonal (masked before exp: no overflow)
    ratio = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf"))
    ratio = ratio.exp()  # [H, C, L, L]
    strict = ratio.masked_fill(causal.diag().diag_embed(), 0.0)  # [H, C, L, L]: j < i only

    k_beta = k * beta[..., None]
    system = torch.eye(chunk, device=q.device) + (k_beta @ k.transpose(-1, -2)) * strict
    decay = log_decay.exp()  # [H, C, L]: G_i
    rhs = torch.cat([v * beta[..., None], k_beta * decay[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_from_v, w = solved[..., :dv], solved[..., dv:]  # U = u_from_v - w @ S0
    scores = (q @ k.transpose(-1, -2)) * ratio  # [H, C, L, L]
    q_decayed = q * decay[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]  # (G_last / G_j) k_j
    chunk_decay = decay[..., -1, None, None]  # [H, C, 1, 1]

    s = torch.zeros(heads, dk, dv, dtype=q.dtype, device=q.device) if state is None else state
    out = torch.empty(heads, chunks, chunk, dv, dtype=q.dtype, device=q.device)
    wanted = {r // chunk for r in states_at}
    for c in range(chunks):
        if c in wanted and states is not None:
            states.append(s)
        u = u_from_v[:, c] - w[:, c] @ s  # [H, L, Dv]
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ u
        s = s * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.reshape(heads, chunks * chunk, dv)[:, :n], s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state
    [B, H, Dk, Dv]; float32 -> (out [B, H, Dv], new state)."""
    s = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    update = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * update[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


FLA_CONFIGS = Path(__file__).resolve().parent.parent / "device" / "fla_configs"
FLA_DEVICE_FILE = "_device.json"  # in each kept folder: the GPU's name and compute capability


def fla_config_folder() -> Path:
    """Where fla's autotune choices for this GPU are kept (``tools/tune_fla_prefill.py``
    writes them): ``FLA_CONFIGS / <the GPU's name as fla spells it>``."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return FLA_CONFIGS / (re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu")


def fla_capability() -> str | None:
    """This GPU's compute capability as ``"9.0"``; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return "{}.{}".format(*torch.cuda.get_device_capability())


def _folder_capability(folder: Path) -> str | None:
    try:
        return str(json.loads((folder / FLA_DEVICE_FILE).read_text())["capability"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fla_config_dir(
    own: Path | None = None, capability: str | None = None, kept: Path = FLA_CONFIGS
) -> Path | None:
    """The folder fla reads its kernels' configs from: this GPU's kept folder
    (``fla_config_folder``), where a kernel it has no file for takes the file of another kept
    GPU of the same compute capability (an H200 the H100's: the same SMs and shared memory,
    so the same configs launch; chosen for the other card's bandwidth). Such a mix is written
    to ``$TOKENPIPE_CACHE/fla_configs/<gpu>`` (fla reads one folder). None when no kept folder
    applies: fla autotunes every kernel, as it would without us."""
    from worker import cache_dir

    own = fla_config_folder() if own is None else own
    capability = fla_capability() if capability is None else capability
    others = sorted(kept.iterdir()) if capability and kept.is_dir() else []
    kin = [f for f in others if f.name != own.name and _folder_capability(f) == capability]
    chosen: dict[str, Path] = {}
    for folder in (own, *kin):
        for f in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            if f.name != FLA_DEVICE_FILE:
                chosen.setdefault(f.name, f)
    if not chosen:
        return None
    if all(f.parent == own for f in chosen.values()):
        return own
    merged = cache_dir("fla_configs") / own.name
    try:
        merged.mkdir(parents=True, exist_ok=True)
        for name, f in chosen.items():
            body = f.read_bytes()
            target = merged / name
            if not target.is_file() or target.read_bytes() != body:
                temp = merged / f".{name}.{os.getpid()}"
                temp.write_bytes(body)
                os.replace(temp, target)  # workers of several GPUs may write it at once
        for stale in merged.glob("*.json"):
            if stale.name not in chosen:
                stale.unlink(missing_ok=True)
    except OSError:  # a read-only cache: this GPU's own files, the rest autotuned
        return own if own.is_dir() else None
    return merged


def fla_installed() -> bool:
    """Whether fla is installed here and not turned off (TOKENPIPE_NO_FLA=1), without importing
    it (``tokenpipe info`` asks this for the GPU worker it estimates)."""
    import importlib.util

    if os.environ.get("TOKENPIPE_NO_FLA") == "1":
        return False
    return importlib.util.find_spec("fla") is not None


@functools.cache
def fla_chunk_rule() -> Any:
    """flash-linear-attention's ``chunk_gated_delta_rule`` when ``fla`` imports (and
    TOKENPIPE_NO_FLA is not 1), else None. When kept choices apply to this GPU
    (``fla_config_dir``) and the environment does not choose otherwise, fla reads its kernels'
    configs there instead of autotuning them (most of a first start's time); a kernel without a
    file there is autotuned as before. Lookups are fuzzy (fla's FLA_CACHE_MODE): a
    shape of other sizes but the same dtypes takes the kept config (valid at any size; tuned
    for the shipped model's DeltaNet heads)."""
    if not fla_installed():
        return None
    folder = fla_config_dir() if "FLA_CONFIG_DIR" not in os.environ else None
    if folder is not None:
        os.environ["FLA_CONFIG_DIR"] = str(folder)  # read when fla is first imported
        os.environ.setdefault("FLA_CACHE_MODE", "fuzzy")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # ImportError, or an install that does not run here
        return None
    return chunk_gated_delta_rule


@functools.cache
def fla_stages() -> SimpleNamespace | None:
    """The stages ``chunk_gated_delta_rule`` runs (fla 0.6's forward: l2norm, chunk-local
    cumsum of g, the intra-chunk WY solve, the state pass, the output pass), to call one by one
    when a prefill also wants the state at chunk boundaries inside it (``prefill_states``);
    None when fla is off or this fla lacks them (then such a prefill is split there)."""
    if fla_chunk_rule() is None:
        return None
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception:  # another fla version's layout
        return None
    return SimpleNamespace(
        l2norm=l2norm_fwd, cumsum=chunk_local_cumsum, intra=chunk_gated_delta_rule_fwd_intra,
        states=chunk_gated_delta_rule_fwd_h, out=chunk_fwd_o, log2e=RCP_LN2,
    )  # fmt: skip


def prefill_states(device: torch.device | str, dtype: torch.dtype) -> int:
    """The row multiple (relative to a sequence's first row in a step) at which this device's
    DeltaNet prefill can hand out the state inside the step without splitting the sequence
    there: ``CHUNK`` for the torch form and fla's stages (both carry the state chunk to chunk),
    0 when the prefill goes through fla's single call (no stages: every state inside a step is
    a split)."""
    if torch.device(device).type != "cuda" or dtype == torch.float32:
        return CHUNK  # the torch form
    if fla_chunk_rule() is None or fla_stages() is not None:
        return CHUNK
    return 0


_fla_broken: list[str] = []  # the error of fla's first failed call: the torch form from then on


class GatedRMSNorm(RMSNorm):
    """weight * rms_norm(x) (llama style), then * silu(gate) in float32."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        assert self.weight is not None
        return ((self.weight * normed) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """``linear_attn`` of a qwen3_5_moe layer (HF names)."""

    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        spec = config.deltanet
        assert spec is not None
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = spec.num_key_heads, spec.num_value_heads
        self.dk, self.dv = spec.key_head_dim, spec.value_head_dim
        self.key_dim = self.num_k_heads * self.dk
        self.value_dim = self.num_v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = spec.conv_kernel
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False, **factory)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False, **factory)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False, **factory)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False, **factory)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel,
            groups=self.conv_dim,
            bias=False,
            padding=self.conv_kernel - 1,
            **factory,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, **factory))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, **factory))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps, LLAMA_NORM, **factory)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False, **factory)
        self.in_proj_all: nn.Linear | None = None  # set by fuse_projections (CUDA)

    def fuse_projections(self) -> None:
        """On CUDA: ``in_proj_qkv``, ``_z``, ``_b`` and ``_a`` become one matmul
        (``in_proj_all``, rows in that order; the HF names are gone afterwards). The CPU path
        packs each weight on its own (``CausalLM.prepare_for_cpu``) and keeps them apart."""
        device = self.dt_bias.device.type  # the projections may be quantized (no .weight)
        if self.in_proj_all is not None or device not in FUSED_PROJECTION_DEVICES:
            return
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        fused = _concat_linears(parts)
        if fused is None:
            return
        self.in_proj_all = fused
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def _project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> mixed [T, conv_dim], z [T, Hv, Dv], a, b [T, Hv] (views of one
        matmul's output once fused)."""
        t = x.shape[0]
        if self.in_proj_all is None:
            z = self.in_proj_z(x).view(t, self.num_v_heads, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_a(x), self.in_proj_b(x)
        proj = self.in_proj_all(x)
        widths = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        mixed, z, b, a = torch.split(proj, widths, dim=-1)
        return mixed, z.view(t, self.num_v_heads, self.dv), a, b

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: object,  # unused: no positions in a recurrence
        cache: DeltaNetLayerCache,
        plan: Any,  # AttentionPlan, or a tensor-only decode plan (module doc)
    ) -> torch.Tensor:
        del cos_sin
        t = x.shape[0]
        mixed, z, a, b = self._project(x)  # [T, conv_dim], [T, Hv, Dv], [T, Hv], [T, Hv]
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        state_meta = getattr(plan, "state_meta", None)
        if state_meta is not None:  # one sequence's short prefill, captured (module doc)
            out = self._prefill_rows(mixed, a, b, weight, cache, state_meta)
        elif not isinstance(plan, AttentionPlan):
            out = self._decode_rows(mixed, a, b, weight, cache, plan.slots, padded=True)
        else:
            out = torch.empty(t, self.num_v_heads, self.dv, dtype=torch.float32, device=x.device)
            if plan.decode:
                rows, slots = plan.decode_rows, plan.decode_slots
                assert rows is not None and slots is not None
                out[rows] = self._decode_rows(
                    mixed[rows], a[rows], b[rows], weight, cache, slots, padded=False
                )
            if plan.prefill:
                self._prefill(mixed, self._decay(a), b.float().sigmoid(), weight, cache, plan, out)
        if use_triton(x) and self.norm.weight is not None:
            from worker.device.kernels.deltanet_decode import gated_rms_norm_triton

            normed = gated_rms_norm_triton(out, z, self.norm.weight, self.norm.eps, x.dtype)
        else:
            normed = self.norm(out.to(x.dtype), z)  # [T, Hv, Dv]
        result: torch.Tensor = self.out_proj(normed.reshape(t, self.value_dim))
        return result

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """a [N, Hv] -> g = -exp(A_log) * softplus(a + dt_bias) [N, Hv] float32 (log decay)."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _prefill(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        weight: torch.Tensor,
        cache: DeltaNetLayerCache,
        plan: AttentionPlan,
        out: torch.Tensor,
    ) -> None:
        """Each prefill sequence from its slot's state (or zeros). A state asked for inside
        the step (a slot snapshot or a prefix-pool state: ``cache.split_points``) comes out of
        the pass itself when it sits a multiple of ``cache.free_split`` rows into it (the
        torch form and fla's stages carry the state chunk to chunk: the same state a split
        there gives); anywhere else the sequence is split there."""
        free = cache.free_split
        kernel = weight.shape[-1]
        for seq in plan.prefill:
            conv = None if seq.cached == 0 else cache.conv[seq.slot]
            state = None if seq.cached == 0 else cache.recurrent[seq.slot]
            lo, inner = 0, []
            for point in [*cache.split_points(seq.slot, seq.cached, seq.new), seq.new]:
                if point < seq.new and free and (point - lo) % free == 0:
                    inner.append(point - lo)  # read inside the pass below
                    continue
                part = mixed[seq.start + lo : seq.start + point]
                conv_out, conv_end = causal_conv1d(part, conv, weight)
                states: list[torch.Tensor] = []
                rows = slice(seq.start + lo, seq.start + point)
                out[rows], state_end = self._core_prefill(
                    conv_out, g[rows], beta[rows], state, inner, states
                )
                for r, inside in zip(inner, states, strict=True):
                    at = conv_state_after(part, conv, r, kernel)
                    cache.save_snapshot(seq.slot, seq.cached + lo + r, at, inside)
                conv, state = conv_end, state_end
                if point < seq.new:  # a split: the state after `cached + point` tokens
                    cache.save_snapshot(seq.slot, seq.cached + point, conv, state)
                lo, inner = point, []
            assert conv is not None and state is not None
            cache.conv[seq.slot] = conv
            cache.recurrent[seq.slot] = state

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [N, conv_dim] -> q, k [N, Hv, Dk] (normalised, heads shared, q scaled),
        v [N, Hv, Dv]; float32."""
        n = mixed.shape[0]
        q, k, v = torch.split(mixed.float(), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.reshape(n, self.num_k_heads, self.dk)) * self.dk**-0.5
        k = l2_normalize(k.reshape(n, self.num_k_heads, self.dk))
        group = self.num_v_heads // self.num_k_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return q, k, v.reshape(n, self.num_v_heads, self.dv)

    def _core_prefill(
        self,
        conv_out: torch.Tensor,  # [n, conv_dim]
        g: torch.Tensor,  # [n, Hv]
        beta: torch.Tensor,  # [n, Hv]
        state: torch.Tensor | None,  # [Hv, Dk, Dv] float32
        inner: Sequence[int] = (),
        states: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out [n, Hv, Dv] float32, state after the n tokens); the states after each of
        ``inner`` rows (multiples of ``CHUNK``, ascending) appended to ``states``. One token
        (the tail a snapshot before a named prompt's last token splits off) takes the
        recurrence: a dozen small launches instead of a chunked pass (fla's costs ~1 ms of host
        time a call)."""
        if conv_out.shape[0] == 1 and not inner:
            q, k, v = self._split_qkv(conv_out)
            if state is None:
                state = q.new_zeros(self.num_v_heads, self.dk, self.dv)
            out, after = recurrent_gated_delta_rule(q, k, v, g, beta, state[None])
            return out, after[0]
        rule = fla_chunk_rule() if conv_out.is_cuda and conv_out.dtype != torch.float32 else None
        if rule is not None and not _fla_broken:
            try:
                stages = fla_stages()
                if stages is not None:
                    return self._fla_stages_prefill(stages, conv_out, g, beta, state, inner, states)
                assert not inner, "states inside an fla call need its stages"
                return self._fla_prefill(rule, conv_out, g, beta, state)
            except Exception as exc:  # noqa: BLE001 - the torch form computes the same
                _fla_broken.append(repr(exc))
                print(f"deltanet: fla failed ({exc!r}); torch prefill", file=sys.stderr)
                if states is not None:
                    states.clear()
        q, k, v = self._split_qkv(conv_out)
        out, state = chunked_gated_delta_rule(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T, state,
            states_at=inner, states=states,
        )  # fmt: skip
        return out.transpose(0, 1), state

    def _fla_prefill(
        self,
        rule: Any,
        conv_out: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_core_prefill`` through fla: q/k [1, n, Hk, Dk] (normalised in the kernel, key
        heads shared by value heads there too), v [1, n, Hv, Dv] in the model's dtype."""
        n = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        out, final = rule(
            q.reshape(1, n, self.num_k_heads, self.dk),
            k.reshape(1, n, self.num_k_heads, self.dk),
            v.reshape(1, n, self.num_v_heads, self.dv),
            g[None],
            beta[None],
            scale=self.dk**-0.5,
            initial_state=None if state is None else state[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out[0].float(), final[0]

    def _fla_stages_prefill(
        self,
        stages: SimpleNamespace,
        conv_out: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        inner: Sequence[int],
        states: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_fla_prefill`` through fla's stages (``fla_stages``: the kernels its single call
        runs, on the same contiguous inputs), plus each ``inner`` row's state: the state pass
        again over the rows before it (its chunks are the full pass's first ones, so the state
        is the one the full pass carries there, in float32; one more launch a point)."""
        n = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        with torch.cuda.device(conv_out.device):
            q, _ = stages.l2norm(q.reshape(1, n, self.num_k_heads, self.dk).contiguous())
            k, _ = stages.l2norm(k.reshape(1, n, self.num_k_heads, self.dk).contiguous())
            v = v.reshape(1, n, self.num_v_heads, self.dv).contiguous()
            g = stages.cumsum(g[None].contiguous(), chunk_size=CHUNK, scale=stages.log2e)
            w, u, _ = stages.intra(k=k, v=v, g=g, beta=beta[None].contiguous(), chunk_size=CHUNK)
            start = None if state is None else state[None].contiguous()
            h, v_new, final = stages.states(
                k=k, w=w, u=u, g=g, initial_state=start, output_final_state=True,
                chunk_size=CHUNK,
            )  # fmt: skip
            out = stages.out(q=q, k=k, v=v_new, h=h, g=g, scale=self.dk**-0.5, chunk_size=CHUNK)
            for r in inner:
                assert states is not None and 0 < r < n and r % CHUNK == 0
                _, _, at = stages.states(
                    k=k[:, :r], w=w[:, :r], u=u[:, :r], g=g[:, :r], initial_state=start,
                    output_final_state=True, chunk_size=CHUNK, save_new_value=False,
                )  # fmt: skip
                states.append(at[0])
        return out[0].float(), final[0]

    def _prefill_rows(
        self,
        mixed: torch.Tensor,  # [N, conv_dim]
        a: torch.Tensor,  # [N, Hv]
        b: torch.Tensor,  # [N, Hv]
        weight: torch.Tensor,
        cache: DeltaNetLayerCache,
        state_meta: torch.Tensor,  # [5] int64: slot, cached, n, snapshot rows, entry
    ) -> torch.Tensor:
        """The rows of one sequence's prefill (padding after n) through the in-place Triton
        conv and recurrence, its snapshot inside the step included -> out [N, Hv, Dv]
        float32. The prefill graphs' path (worker/device/prefill_graphs.py): no host value
        read, one launch each."""
        from worker.device.kernels.deltanet_decode import conv_seq_triton, gated_delta_seq_triton

        conv_out = conv_seq_triton(mixed, cache.conv, cache.snap_conv, weight, state_meta)
        return gated_delta_seq_triton(
            conv_out, a, b, self.A_log, self.dt_bias, cache.recurrent, cache.snap_recurrent,
            state_meta, num_key_heads=self.num_k_heads, key_dim=self.dk,
        )  # fmt: skip

    def _decode_rows(
        self,
        mixed: torch.Tensor,  # [B, conv_dim]
        a: torch.Tensor,  # [B, Hv]
        b: torch.Tensor,  # [B, Hv]
        weight: torch.Tensor,
        cache: DeltaNetLayerCache,
        slots: torch.Tensor,  # [B] int64, -1: padding (nothing stored)
        padded: bool,  # whether some slot may be -1
    ) -> torch.Tensor:
        """One new token per row, each continuing its slot's state -> out [B, Hv, Dv]
        float32."""
        if use_triton(mixed):
            from worker.device.kernels.deltanet_decode import (
                conv_step_triton,
                gated_delta_step_triton,
            )

            conv_out = conv_step_triton(mixed, cache.conv, weight, slots)
            return gated_delta_step_triton(
                conv_out, a, b, self.A_log, self.dt_bias, cache.recurrent, slots,
                num_key_heads=self.num_k_heads, key_dim=self.dk,
            )  # fmt: skip
        if padded:  # the live rows only (a host sync: the torch path, not in a graph)
            out = torch.zeros(mixed.shape[0], self.num_v_heads, self.dv, device=mixed.device)
            live = torch.nonzero(slots >= 0).flatten()
            if live.numel():
                out[live] = self._decode_rows(
                    mixed[live], a[live], b[live], weight, cache, slots[live], padded=False
                )
            return out
        conv_out, conv = causal_conv1d_step(mixed, cache.conv[slots], weight)
        q, k, v = self._split_qkv(conv_out)
        g, beta = self._decay(a), b.float().sigmoid()
        out, state = recurrent_gated_delta_rule(q, k, v, g, beta, cache.recurrent[slots])
        cache.conv[slots] = conv
        cache.recurrent[slots] = state
        return out
