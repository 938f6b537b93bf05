"""Rotary position embeddings (the rotate-half layout Hugging Face checkpoints use).

Every rope type reduces to ``inv_freq`` ([head_dim // 2] float32, zeros for dimensions that do
not rotate) and a scale applied to cos/sin. Dimension i is paired with i + head_dim // 2.
"""

from __future__ import annotations

import math

import torch

from worker.models.config import RopeSpec


def rope_frequencies(
    spec: RopeSpec, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on CPU, cos/sin scale) for one layer type."""
    half = head_dim // 2
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (spec.theta**exponents)  # [half]

    if spec.rope_type == "default":
        return inv_freq, 1.0
    if spec.rope_type == "linear":
        return inv_freq / spec.factor, 1.0
    if spec.rope_type == "proportional":
        # only the first `rotated` pairs turn; exponents stay relative to the full head_dim
        rotated = int(spec.partial_rotary_factor * head_dim // 2)
        inv_freq = torch.cat([inv_freq[:rotated], torch.zeros(half - rotated)])
        return inv_freq / spec.factor, 1.0
    if spec.rope_type == "llama3":
        return _llama3(inv_freq, spec), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec, head_dim, max_position_embeddings)
    raise ValueError(f"unsupported rope type {spec.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    assert spec.original_max_position_embeddings is not None
    old_context = spec.original_max_position_embeddings
    low_freq_wavelen = old_context / spec.low_freq_factor
    high_freq_wavelen = old_context / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_context / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    spec: RopeSpec, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original = spec.original_max_position_embeddings or max_position_embeddings
    factor = spec.factor
    base = spec.theta

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = spec.attention_factor
    if attention_factor is None:
        if spec.mscale and spec.mscale_all_dim:
            attention_factor = get_mscale(factor, spec.mscale) / get_mscale(
                factor, spec.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class Rotary:
    """cos/sin tables of one layer type, computed per step from absolute positions."""

    def __init__(self, spec: RopeSpec, head_dim: int, max_position_embeddings: int) -> None:
        self.head_dim = head_dim
        with torch.device("cpu"):  # models are built under torch.device("meta")
            self.inv_freq, self.scale = rope_frequencies(spec, head_dim, max_position_embeddings)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, head_dim] in ``dtype``."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim // 2] float32
        angles = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim]
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, head_dim] -> x rotated, same shape."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]
