"""FP8 formats and the quantize/dequantize step exactly as vLLM writes its KV cache.

Convention used everywhere in kvcal: a *scale* is the dequantization multiplier,
``x ≈ fp8(x / scale) * scale``, so an absmax calibration gives ``scale = amax / fmt.max``
(torchao's scale is the reciprocal of ours).
"""

from dataclasses import dataclass

import torch

from .choices import FP8_FORMATS, check_fp8_format, check_table


@dataclass(frozen=True)
class FP8Format:
    """Limits of one FP8 encoding."""

    name: str
    dtype: torch.dtype
    max: float  # largest finite magnitude
    min_normal: float  # smallest normal magnitude
    min_subnormal: float  # smallest non-zero magnitude
    mantissa_bits: int


FORMATS: dict[str, FP8Format] = {
    "e4m3fn": FP8Format("e4m3fn", torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, 3),
    # ROCm (MI300, gfx94x): exponent bias one larger, so a code is worth half its e4m3fn value; 0x7F is
    # 240 (not NaN) and 0x80 is the only NaN (no -0).
    "e4m3fnuz": FP8Format("e4m3fnuz", torch.float8_e4m3fnuz, 240.0, 2.0**-7, 2.0**-10, 3),
}

check_table(FORMATS, FP8_FORMATS, "fp8.FORMATS")

# vLLM's ``--kv-cache-dtype fp8_e5m2`` (emulated in kvdtypes.py). Not in FORMATS: kvcal writes e4m3 scales only.
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, 2)

# "Saturated" means beyond the largest finite value by more than this (relative): a float32 scale is within 2^-24
# of amax / fmt.max, so the largest value it was made for lands a hair above fmt.max and is stored as fmt.max,
# rounded like any other value, not clipped.
SATURATION_SLACK = 2.0**-20

# Smallest scale kvcal ever writes: an all-zero layer gets this floor (with a warning), so no
# scale is zero, and any real value up to 448 * SCALE_FLOOR is still representable.
SCALE_FLOOR = 1e-6


def get_format(name: str) -> FP8Format:
    """Look up an FP8 format by name, with an error that lists the choices."""
    check_fp8_format(name)
    return FORMATS[name]


@torch.no_grad()
def amax_to_scale(
    amax: torch.Tensor, fmt: FP8Format = FORMATS["e4m3fn"], *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantization scale that maps ``amax`` onto the format's largest finite value, computed in float64.

    Zero amax gives SCALE_FLOOR rather than zero; NaN/Inf amax raise. ``dtype`` is the result's: float32 as
    checkpoints hold scales, float64 for observers that go on computing with it (headroom, the MSE search).
    """
    amax = amax.to(torch.float64)
    if not torch.isfinite(amax).all():
        raise ValueError("amax contains NaN or Inf; the activations it came from are not finite")
    return (amax / fmt.max).clamp(min=SCALE_FLOOR).to(dtype)


@torch.no_grad()
def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format = FORMATS["e4m3fn"]) -> torch.Tensor:
    """FP8 encoding of ``x / scale``: saturate to ±fmt.max, round to nearest even (vLLM's cache write).

    ``scale`` broadcasts against ``x``. NaN stays NaN.
    """
    y = x.float() / scale
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)


@torch.no_grad()
def quantize_dequantize(
    x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format = FORMATS["e4m3fn"]
) -> torch.Tensor:
    """What reading ``x`` back from an FP8 cache gives: ``fp8(x / scale) * scale``, in x's dtype."""
    return (quantize(x, scale, fmt).float() * scale).to(x.dtype)


@torch.no_grad()
def per_token_scale(x: torch.Tensor, fmt: FP8Format = FORMATS["e4m3fn"], floor: float = 1e-6) -> torch.Tensor:
    """vLLM's ``fp8_per_token_head`` scale: max(amax over the last dim / fmt.max, floor), float32.

    ``x`` is [..., head_dim]; the result is [..., 1] so it broadcasts back over head_dim.
    """
    amax = x.float().abs().amax(dim=-1, keepdim=True)  # [..., 1]
    return (amax / fmt.max).clamp(min=floor)
