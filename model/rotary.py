"""Rotary position embeddings in Hugging Face's rotate-half convention (channel i pairs with i + hs/2), so
Hugging Face's q and k weights load unpermuted; with Llama 3.1's frequency scaling."""

import math

import torch

from model.config import GPTConfig


def inverse_frequencies(config: GPTConfig) -> torch.Tensor:
    """The hs/2 rotation frequencies (fp32): theta^(-2i/hs), and under rope_scaling=llama3 the long wavelengths
    slowed by rope_factor, smoothly between the two wavelength bounds (transformers' `_compute_llama3_parameters`)."""
    hs = config.head_size
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs))  # (hs/2,)
    if config.rope_scaling == "none":
        return inv_freq
    original = config.rope_original_max_positions
    low_wavelen = original / config.rope_low_freq_factor
    high_wavelen = original / config.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / config.rope_factor, inv_freq)
    smooth = (original / wavelen - config.rope_low_freq_factor) / (
        config.rope_high_freq_factor - config.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / config.rope_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotary_key(config: GPTConfig) -> tuple:
    """The fields the angles depend on, and the sequence length: configs that agree on them share one table. The
    length is in the key so that a table's size never depends on which models the process built before: compiled blocks
    save the table for backward, so its size is bytes the planner counts (parallel/measurement/compiled_bytes.py)."""
    return (
        config.seq_len,
        config.head_size,
        config.rope_theta,
        config.rope_scaling,
        config.rope_factor,
        config.rope_low_freq_factor,
        config.rope_high_freq_factor,
        config.rope_original_max_positions,
    )


_ANGLES: dict[tuple, torch.Tensor] = {}
"""(rotary fields, device) -> the fp32 angles (positions, hs) of positions 0 .. positions - 1, built once per device
(and rebuilt larger when a longer sequence asks): the frequencies cross from host to device once, not in every
attention call, where a copy from pageable memory would make the stream wait for the host."""


def rotary_angles(config: GPTConfig, end: int, device: torch.device) -> torch.Tensor:
    """The angles (end', hs) of positions 0 .. end' - 1 for some end' >= end, on `device` (fp32)."""
    key = (_rotary_key(config), device)
    table = _ANGLES.get(key)
    if table is None or table.shape[0] < end:
        positions = max(end, config.seq_len, 2 * table.shape[0] if table is not None else 0)
        # A table built under inference mode (sampling) must stay usable by training's autograd.
        with torch.inference_mode(False), torch.no_grad():
            inv_freq = inverse_frequencies(config).to(device)  # (hs/2,)
            freqs = torch.outer(torch.arange(positions, device=device, dtype=torch.float32), inv_freq)  # (P, hs/2)
            table = torch.cat((freqs, freqs), dim=-1)  # (P, hs)
        _ANGLES[key] = table
    return table


def rotary_cos_sin(
    config: GPTConfig, start: int, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, hs) of positions start .. start + T - 1, computed in fp32 and rounded to `dtype`. Each call
    makes its own cos and sin (what apply_rotary keeps for backward, per block, as the planner counts them) from the
    device's cached angles: elementwise, so bit-identical to computing the angles anew."""
    angles = rotary_angles(config, start + length, device)[start : start + length]  # (T, hs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hs) rotated by position: keeps cos and sin (T, hs) for backward, not x."""
    return x * cos + rotate_half(x) * sin
