"""RoPE tables: inverse frequencies of every `RopeScaling.rope_type`, as transformers computes them, and the
cos/sin cache the rotary kernels read.

Two types depend on the running context length in transformers, and are fixed here at the engine's longest
context (`max_position`) so that one table serves every sequence of a batch:
- dynamic (NTK): transformers keeps the plain base until a sequence passes max_position_embeddings; here the
  base is the one transformers would use at max_position (plain when max_position <= max_position_embeddings).
- longrope: transformers uses the long factors once a sequence passes original_max_position_embeddings; here
  the long factors are used when max_position does.
Within those bounds the tables equal transformers' exactly.
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None, *, max_position: int,
                        max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """([rotary_dim // 2] float32 inverse frequencies, attention factor that multiplies cos and sin)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # [rotary_dim / 2]
    plain = 1.0 / (theta ** exponents)
    if scaling is None:
        return plain, 1.0
    kind = scaling.rope_type
    if kind == "llama3":
        return _llama3(plain, scaling), 1.0
    if kind == "linear":
        return plain / scaling.factor, 1.0
    if kind == "dynamic":
        seq_len = max(max_position, max_position_embeddings)
        base = theta * ((scaling.factor * seq_len / max_position_embeddings) - (scaling.factor - 1)) ** (
            rotary_dim / (rotary_dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(exponents, theta, scaling, max_position, max_position_embeddings)
    raise ValueError(f"rope_type {kind!r} is not supported")


def rope_cos_sin_cache(rotary_dim: int, max_position: int, theta: float, scaling: RopeScaling | None,
                       max_position_embeddings: int | None = None) -> torch.Tensor:
    """[max_position, rotary_dim] float32: cos of each (position, frequency) then sin, the layout kernels expect."""
    inv_freq, attention_factor = inverse_frequencies(
        rotary_dim, theta, scaling, max_position=max_position,
        max_position_embeddings=max_position_embeddings or max_position)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    if attention_factor == 1.0:
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: RopeScaling, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope(exponents: torch.Tensor, base: float, s: RopeScaling, max_position: int,
              max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = s.long_factor if max_position > original else s.short_factor
    if len(ext) != exponents.numel():
        raise ValueError(f"longrope factors have {len(ext)} entries, expected rotary_dim / 2 = {exponents.numel()}")
    inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** exponents)
    return inv_freq, float(attention_factor)
