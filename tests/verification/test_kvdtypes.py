"""Tests for calibrate/verification/kvdtypes.py against independent models of each vLLM KV-cache write
(docs/kv-dtypes.md).

References are float64 numpy: the kernels' float32 steps (scale, reciprocal, products) are reproduced with numpy
float32 scalars in the kernels' order, and every rounding to a format is a search over that format's values
(e2m1 by its 8 magnitudes, e4m3 by its 256 codes as in test_fp8.py, e5m2 decoded from its bit layout), ties to the
even code. The int4 rotation is checked against a Sylvester Hadamard matrix and, where scripts/setup-vllm has made
.venv-vllm, bit for bit against vLLM's own function in that venv.
"""

import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from references import e4m3_round
from runners import client_python

from calibrate import fp8
from calibrate.verification.kvdtypes import (
    DTYPES,
    int4_round_trip_rotated,
    rht,
    rht_block,
    rht_signs,
    round_e2m1,
    round_half_away,
)

REPO = Path(__file__).resolve().parents[2]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])  # index == code of the magnitude
F32 = np.float32


def e2m1_reference(y: np.ndarray) -> np.ndarray:
    """Nearest e2m1 value by searching all 8 magnitudes (saturating at 6), ties to the even code; float64."""
    a = np.minimum(np.abs(y), 6.0)
    dist = np.abs(a[..., None] - E2M1)  # [..., 8]
    best = dist.min(-1, keepdims=True)
    codes = np.where(dist == best, np.arange(8), 99)  # the tied codes, else 99
    even = np.where(codes % 2 == 0, codes, 99).min(-1)
    code = np.where(even < 99, even, codes.min(-1))  # a tie always has one even code
    return np.copysign(E2M1[code], y)


def as_bfloat16(x: np.ndarray) -> np.ndarray:
    """float64 x rounded to float32 (the emulation's arithmetic), then to bfloat16 (its result's dtype)."""
    return torch.from_numpy(x).float().to(torch.bfloat16).double().numpy()


def round_half_away_reference(t: np.ndarray) -> np.ndarray:
    """Round half away from zero in float64: exact for any float32 ``t``."""
    return np.sign(t) * np.floor(np.abs(t) + 0.5)


def hadamard(b: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order b (a power of two), float64: H·Hᵀ = b·I."""
    h = np.ones((1, 1))
    while len(h) < b:
        h = np.block([[h, h], [h, -h]])
    return h


def rotate_reference(x: np.ndarray, signs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """vLLM's int4 rotation in float64: per block of b = len(signs), (x · signs) @ H, or (x @ H) · signs."""
    b = len(signs)
    blocks = x.reshape(*x.shape[:-1], -1, b)  # [..., D/b, b]
    out = (blocks @ hadamard(b)) * signs if inverse else (blocks * signs) @ hadamard(b)
    return out.reshape(x.shape)


# --- round_e2m1 -----------------------------------------------------------------------------------------------

def test_round_e2m1_keeps_representable_values():
    grid = torch.tensor(np.concatenate([E2M1, -E2M1]), dtype=torch.float32)
    assert torch.equal(round_e2m1(grid), grid)


MIDPOINTS = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}  # → the even code


@pytest.mark.parametrize("value", MIDPOINTS)
def test_round_e2m1_midpoints_go_to_even_code(value):
    got = round_e2m1(torch.tensor([value, -value]))
    assert got.tolist() == [MIDPOINTS[value], -MIDPOINTS[value]]


def test_round_e2m1_saturates():
    x = torch.tensor([6.0, 6.5, 7.0, 100.0, 3e38, float("inf")])
    assert round_e2m1(x).tolist() == [6.0] * 6
    assert round_e2m1(-x).tolist() == [-6.0] * 6


def test_round_e2m1_equals_brute_force_search():
    rng = np.random.default_rng(0)
    mids = (E2M1[:-1] + E2M1[1:]) / 2
    nudged = np.concatenate([np.nextafter(mids.astype(F32), F32(0)), np.nextafter(mids.astype(F32), F32(9))])
    y = np.concatenate([rng.uniform(-8, 8, 50_000), rng.standard_normal(10_000) * 0.3, mids, nudged])
    y = np.concatenate([y, -y]).astype(F32)
    got = round_e2m1(torch.from_numpy(y)).double().numpy()
    np.testing.assert_array_equal(got, e2m1_reference(y.astype(np.float64)))


# --- int8_per_token_head ---------------------------------------------------------------------------------------

def int8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, dequantized) of vLLM's int8 per-token-head write; x float32 [..., D]."""
    s = np.maximum(np.abs(x).max(-1, keepdims=True) / F32(127), F32(1e-6))  # float32 scale
    t = x * (F32(1) / s)  # float32, the kernel's multiply by the reciprocal
    codes = np.clip(round_half_away_reference(t.astype(np.float64)), -128, 127)
    return codes, codes * s.astype(np.float64)


def test_int8_per_token_head_equals_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 33, 64)) * np.exp(rng.uniform(-8, 4, (2, 4, 33, 1)))
    x[0, 0, 0] = 0  # all zero: the 1e-6 floor
    x[1, 2, 3] = -np.abs(x[1, 2, 3])  # the absmax element negative
    x = torch.from_numpy(x).to(torch.bfloat16)
    got = DTYPES["int8_per_token_head"].round_trip(x)
    codes, want = int8_reference(x.float().numpy())
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.double().numpy(), as_bfloat16(want))
    assert codes.min() == -127 and codes.max() == 127  # the range is symmetric: −128 is never written


def test_int8_ties_round_away_from_zero():
    """With absmax 127 the scale and its reciprocal are 1, so x · (1/s) is x and the ties are exact."""
    x = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, -127], dtype=torch.float32)
    want = [127, 1, 2, 3, -1, -2, -3, 127, -127, -127]
    assert DTYPES["int8_per_token_head"].round_trip(x.view(1, 1, 1, -1)).flatten().tolist() == want


def test_round_half_away_adds_half_in_float32_like_the_kernel():
    """0.5 − 2⁻²⁵ + 0.5 is a float32 tie that rounds up to 1.0, so the kernel's ``(t + 0.5)`` truncates to 1."""
    t = torch.tensor([0.5 - 2**-25, -(0.5 - 2**-25), 0.5 - 2**-24], dtype=torch.float32)
    assert round_half_away(t).tolist() == [1.0, -1.0, 0.0]


# --- fp8 and fp8_per_token_head ------------------------------------------------------------------------------

def test_fp8_is_per_tensor_e4m3():
    x = torch.randn(2, 3, 5, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16) * 20
    scale = torch.tensor([0.01, 0.02, 0.05]).view(1, 3, 1, 1)
    assert torch.equal(DTYPES["fp8"].round_trip(x, scale), fp8.quantize_dequantize(x, scale))


def test_fp8_per_token_head_multiplies_by_reciprocal():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 3, 17, 64)) * np.exp(rng.uniform(-6, 6, (2, 3, 17, 1)))).astype(F32)
    # x[1]: rows of 63 float32 steps across an e4m3 tie (1.0625 · s), where x · (1/s) and x / s can round apart.
    amax = rng.uniform(1, 100, (3, 17, 1)).astype(F32)
    tie = amax / F32(448) * F32(1.0625)
    x[1, ..., :1] = amax
    x[1, ..., 1:] = tie + np.arange(-31, 32) * np.spacing(tie)
    s = np.maximum(np.abs(x).max(-1, keepdims=True) / F32(448), F32(1e-6))
    want = e4m3_round((x * (F32(1) / s)).astype(np.float64)) * s
    assert (want != e4m3_round((x / s).astype(np.float64)) * s).any()  # dividing instead would be caught
    got = DTYPES["fp8_per_token_head"].round_trip(torch.from_numpy(x))
    np.testing.assert_array_equal(got.double().numpy(), want.astype(F32).astype(np.float64))


def test_verify_token_scheme_is_fp8_per_token_head():
    """verify's ``token`` scheme and the fp8_per_token_head dtype run one emulation: identical tensors, bit for bit,
    on the tie rows where dividing by s (the token scheme's former arithmetic) rounds apart."""
    from calibrate.verification.schemes import Mode, Scheme

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((1, 2, 33, 64)) * np.exp(rng.uniform(-6, 6, (1, 2, 33, 1)))).astype(F32)
    amax = rng.uniform(1, 100, (2, 33, 1)).astype(F32)
    tie = amax / F32(448) * F32(1.0625)
    x[0, ..., :1] = amax
    x[0, ..., 1:] = tie + np.arange(-31, 32) * np.spacing(tie)
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.from_numpy(x).to(dtype)
        token = Scheme("token", Mode.TOKEN, "", fp8.FORMATS["e4m3fn"], "token")
        _, got, _ = token.apply(0, k, k, k)
        want = DTYPES["fp8_per_token_head"].round_trip(k)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)
        division = fp8.quantize_dequantize(k, fp8.per_token_scale(k))
        assert dtype != torch.float32 or not torch.equal(got, division)


def test_fp8_per_token_head_on_e4m3fnuz_scales_by_224():
    x = torch.randn(1, 1, 4, 32, generator=torch.Generator().manual_seed(9)) * 5
    s = x.abs().amax(-1, keepdim=True) / 224
    q = fp8.per_token_head_round_trip(x, fp8.FORMATS["e4m3fnuz"])
    assert torch.equal(q.abs().amax(-1, keepdim=True), 224 * s)  # each token's largest value lands on code 224


# --- int4_per_token_head --------------------------------------------------------------------------------------

HEAD_DIMS = [8, 64, 80, 96, 128]  # 80 and 96: blocks of 16 and 32


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rotation_is_the_signed_hadamard_and_inverts(d):
    b = rht_block(d)
    assert b & (b - 1) == 0 and d % b == 0 and (d // b) % 2 == 1  # the largest power of two dividing d
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64).float()
    signs = rht_signs(b).double().numpy()
    np.testing.assert_allclose(rht(x).double().numpy(), rotate_reference(x.double().numpy(), signs), rtol=0, atol=1e-5)
    back = rht(rht(x), inverse=True) / b
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=0, atol=1e-5)


def test_sign_vector_is_fixed_and_balanced():
    for b in (2, 16, 128):
        signs = rht_signs(b)
        assert signs.dtype == torch.float32 and signs.shape == (b,)
        assert set(signs.tolist()) <= {-1.0, 1.0}
        assert torch.equal(signs, rht_signs(b))
    assert 32 <= (rht_signs(128) > 0).sum() <= 96


@pytest.mark.slow
def test_rotation_matches_vllm_bit_for_bit(tmp_path):
    """vLLM's _get_rht_signs and single_rht (its CPU butterfly) on the same inputs, run in the vLLM venv."""
    vllm_python = client_python("vLLM")
    inputs = {d: torch.randn(2, 3, d, generator=torch.Generator().manual_seed(d)) for d in HEAD_DIMS}
    torch.save(inputs, tmp_path / "in.pt")
    script = textwrap.dedent(f"""
        import torch
        from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs, single_rht
        inputs = torch.load({str(tmp_path / 'in.pt')!r})
        out = {{"signs": {{b: _get_rht_signs(b, 0, torch.device("cpu")) for b in (2, 8, 16, 32, 64, 128, 256)}},
               "forward": {{d: single_rht(x) for d, x in inputs.items()}},
               "inverse": {{d: single_rht(x, inverse=True) for d, x in inputs.items()}}}}
        torch.save(out, {str(tmp_path / 'out.pt')!r})
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = torch.load(tmp_path / "out.pt")
    for b, signs in theirs["signs"].items():
        assert torch.equal(rht_signs(b), signs), b
    for d, x in inputs.items():
        assert torch.equal(rht(x), theirs["forward"][d]), d
        assert torch.equal(rht(x, inverse=True), theirs["inverse"][d]), d


def int4_reference(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, zero points, reader's scales) of vLLM's int4 write of rotated float32 values r [..., D]."""
    lo, hi = r.min(-1, keepdims=True), r.max(-1, keepdims=True)
    s = np.maximum((hi - lo) / F32(15), F32(1e-6))  # float32
    zp = np.clip(round_half_away_reference((-lo / s).astype(np.float64)), 0, 15).astype(F32)
    codes = np.clip(round_half_away_reference((r * (F32(1) / s) + zp).astype(np.float64)), 0, 15)
    s_read = (s.view(np.int32) & ~np.int32(15)).view(F32)  # the low 4 mantissa bits hold zp in the cache
    return codes, zp.astype(np.float64), s_read.astype(np.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_int4_equals_reference_on_the_16_level_grid(d, dtype):
    """x is k/256 with |k| < 256 (exact in bf16), so the rotation sums are exact and the reference can use H."""
    rng = np.random.default_rng(d)
    x = (np.round(rng.standard_normal((2, 3, 9, d)) * 64).clip(-255, 255) / 256).astype(F32)
    signs = rht_signs(rht_block(d)).double().numpy()
    r = torch.from_numpy(rotate_reference(x.astype(np.float64), signs)).to(dtype).float()  # stored in x's dtype
    codes, zp, s_read = int4_reference(r.numpy())
    deq = (codes - zp) * s_read  # exact in float32: 5 bits times a 20-bit scale
    got_rotated = int4_round_trip_rotated(r).double().numpy()
    np.testing.assert_array_equal(got_rotated, deq)
    levels = got_rotated / s_read + zp  # on the grid: an integer 0..15 per element
    assert (levels == np.round(levels)).all() and levels.min() >= 0 and levels.max() <= 15
    got = DTYPES["int4_per_token_head"].round_trip(torch.from_numpy(x).to(dtype))
    assert got.dtype == dtype
    want = rotate_reference(deq, signs, inverse=True) / rht_block(d)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(got.double().numpy(), want, **tol)


def test_int4_hand_worked_block():
    """Rotated values chosen by hand: range 7.5 gives scale 0.5 (no mantissa bits to mask) and zero point 3."""
    r = np.array([-1.5, 6.0, 0.0, 0.125, 1.125, 1.375, -1.25, 3.75])
    # r / 0.5 + 3 = 0, 15, 3, 3.25, 5.25, 5.75, 0.5 (tie: away from 0 → 1), 10.5 (tie → 11)
    codes = np.array([0, 15, 3, 3, 5, 6, 1, 11])
    signs = rht_signs(8).double().numpy()
    x = rotate_reference(r, signs, inverse=True) / 8  # dyadic: exact in float32, and rotates back to r exactly
    got = DTYPES["int4_per_token_head"].round_trip(torch.tensor(x, dtype=torch.float32).view(1, 1, 1, 8))
    want = rotate_reference((codes - 3) * 0.5, signs, inverse=True) / 8
    np.testing.assert_allclose(got.flatten().double().numpy(), want, rtol=0, atol=1e-6)


# --- nvfp4 and nvfp4_4over6 -----------------------------------------------------------------------------------

def nvfp4_reference(x: np.ndarray, k: float, four_over_six: bool = False) -> np.ndarray:
    """vLLM's nvfp4 write then read of float32 x [..., D] under per-tensor scale k, float64 (float32-rounded).

    nvfp4: FlashInfer's append, sf = e4m3(m / (6·k)), os = 1 / (sf·k). nvfp4_4over6: vLLM's SM100 kernel, g = 1/k,
    sf = e4m3(g·(m·(1/6))), os = 1 / (sf·(1/g)), and the same from m/4 where its squared error is strictly smaller.
    Each float32 step is one float64 operation rounded to float32: exact for a product or quotient of two floats.
    """
    xb = x.reshape(*x.shape[:-1], -1, 16)  # [..., D/16, 16]
    k32 = F32(k)
    m = np.abs(xb).max(-1, keepdims=True)

    def os_of(sf, denominator):
        with np.errstate(divide="ignore"):
            return np.where(sf == 0, F32(0), F32(1) / (sf * denominator))

    def sm100(divisor):
        g = F32(1) / k32
        sf = e4m3_round((g * (m * (F32(1) / F32(divisor)))).astype(np.float64)).astype(F32)
        return sf, os_of(sf, F32(1) / g)

    if four_over_six:
        def err(os):
            q = e2m1_reference((xb * os).astype(np.float64))
            with np.errstate(divide="ignore"):
                back = np.where(os == 0, 0.0, 1.0 / os.astype(np.float64))
            return ((q * back - xb) ** 2).sum(-1, keepdims=True)
        (sf, os), (sf4, os4) = sm100(6), sm100(4)
        use4 = err(os4) < err(os)
        sf, os = np.where(use4, sf4, sf), np.where(use4, os4, os)
    else:
        sf = e4m3_round((m / (F32(6) * k32)).astype(np.float64)).astype(F32)
        os = os_of(sf, k32)
    q = e2m1_reference((xb * os).astype(np.float64))
    return ((q * sf).astype(F32) * k32).reshape(x.shape).astype(np.float64)


def flashinfer_nvfp4_float64(x: np.ndarray, k: float) -> np.ndarray:
    """FlashInfer's nvfp4 writer and reader from its definition alone, in float64 throughout (no float32 step).

    Per 16 elements along the last dim: block max m; block scale sf = the e4m3 value nearest m / (6·k) (saturating
    at 448, ties to even); codes = the e2m1 values {0, .5, 1, 1.5, 2, 3, 4, 6} nearest x / (sf·k); read back as
    code · sf · k. Differs from the float32 kernel only where a float32 rounding moves a value across a midpoint.
    """
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, 16)
    m = np.abs(xb).max(-1, keepdims=True)
    sf = e4m3_round(m / (6.0 * k))
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(sf == 0, 0.0, e2m1_reference(xb / (sf * k)))
    return (q * sf * k).reshape(x.shape)


def test_nvfp4_hand_worked_blocks():
    """k = 0.25 and block max 3 = 6·k·2: sf = e4m3(3 / (6 · 0.25)) = 2, os = 1/(2 · 0.25) = 2, read back q·2·k.

    The second block is the first ÷ 8: sf = 0.25, os = 16, the same codes, read back q / 16.
    """
    y = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0, 0.5, -1.5, 2.9, -4.4, 5.6, 0.0, -0.1, 3.0])
    q = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0, 0.5, -1.5, 3.0, -4.0, 6.0, 0.0, 0.0, 3.0])  # by hand
    x = np.concatenate([y / 2, y / 16]).astype(F32)
    got = DTYPES["nvfp4"].round_trip(torch.from_numpy(x).view(1, 1, 1, 32), torch.tensor(0.25))
    np.testing.assert_array_equal(got.flatten().double().numpy(), np.concatenate([q / 2, q / 16]))


def test_nvfp4_block_scale_saturates_at_448():
    """m = 10752 with k = 1 asks for sf = 1792: it saturates to 448, so os = 1/448 and values above 6·448 clip."""
    x = torch.zeros(16)
    x[:4] = torch.tensor([10752.0, -2688.0, 448 * 2.2, 448 * 0.8])  # · os: 24 → 6, −6, 2.2 → 2, 0.8 → 1
    got = DTYPES["nvfp4"].round_trip(x.view(1, 1, 1, 16), torch.tensor(1.0)).flatten()
    assert got[:4].tolist() == [2688.0, -2688.0, 448 * 2.0, 448 * 1.0]
    assert (got[4:] == 0).all()


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_4over6"])
def test_nvfp4_zero_block_reads_back_zero(name):
    x = torch.zeros(1, 2, 3, 32, dtype=torch.bfloat16)
    x[0, 1, 2, 16:] = 0.75  # one non-zero block beside zero ones: sf = 0.125, 0.75 · 8 = 6 exactly
    got = DTYPES[name].round_trip(x, torch.tensor(1.0))
    assert not got.isnan().any()
    assert torch.equal(got, x)


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_4over6"])
@pytest.mark.parametrize("k", [1.0, 0.01, 3.7 / 2688], ids=["unit", "small", "amax_over_2688"])
def test_nvfp4_equals_reference(name, k):
    rng = np.random.default_rng(4)
    magnitude = np.exp(rng.uniform(-12, 8, (2, 4, 9, 8, 1)))  # per block: subnormal to saturated block scales
    x = torch.from_numpy((rng.standard_normal((2, 4, 9, 8, 16)) * magnitude).reshape(2, 4, 9, 128)).to(torch.bfloat16)
    scale = torch.full((1, 4, 1, 1), k)  # per-tensor, given per head
    got = DTYPES[name].round_trip(x, scale)
    want = nvfp4_reference(x.float().numpy(), k, four_over_six=name == "nvfp4_4over6")
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.double().numpy(), as_bfloat16(want))


def midpoint_distance(y: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Relative distance of |y| (float64) to the nearest midpoint of two adjacent magnitudes of ``grid``."""
    mids = (grid[1:] + grid[:-1]) / 2
    return (np.abs(np.abs(y)[..., None] - mids) / mids).min(-1)


def outlier_heavy(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal values with 0.5% of them 100 times larger, as attention sinks and massive activations give K and V."""
    x = rng.standard_normal(shape)
    return np.where(rng.random(shape) < 0.005, 100 * x, x)


@pytest.mark.parametrize("data", ["normal", "outliers"])
@pytest.mark.parametrize("outer", ["one", "amax_over_448", "amax_over_2688"])
def test_nvfp4_equals_the_writer_computed_in_float64(data, outer):
    """kvcal's nvfp4 emulation against FlashInfer's writer worked out in float64 from its definition (e2m1 codes,
    an e4m3 block scale per 16 elements, the outer scale k): equal wherever no float32 step can move a value across
    a rounding midpoint. At an e2m1 tie (x / (sf·k) a midpoint, which bf16 inputs hit) the kernel's float32 1/(sf·k)
    decides, so the emulation must read back one of the tie's two neighbours; blocks whose m / (6·k) lies within
    float32 rounding of an e4m3 tie, but not on it, are left out, and must be rare. k is 1.0 (vLLM without checkpoint scales), FP8's amax/448 and amax/2688
    (largest block scale at 448), rounded to 12 bits so that 6·k is exact in float32."""
    rng = np.random.default_rng(7)
    shape = (2, 4, 64, 128)
    x = torch.from_numpy(rng.standard_normal(shape) if data == "normal" else outlier_heavy(rng, shape)).to(torch.bfloat16)
    xs = x.double().numpy()
    amax = np.abs(xs).max()
    k = {"one": 1.0, "amax_over_448": amax / 448, "amax_over_2688": amax / 2688}[outer]
    mantissa, exponent = np.frexp(k)
    k = float(np.ldexp(np.round(mantissa * 2**12) / 2**12, exponent))
    got = DTYPES["nvfp4"].round_trip(x, torch.tensor(k)).double().numpy()
    want = as_bfloat16(flashinfer_nvfp4_float64(xs, k))

    blocks = (*shape[:-1], -1, 16)
    xb = xs.reshape(blocks)
    m = np.abs(xb).max(-1, keepdims=True)
    sf = e4m3_round(m / (6 * k))
    e4m3_grid = np.unique(np.abs(e4m3_round(np.linspace(0, 448, 2**16))))
    d = midpoint_distance(m / (6 * k), e4m3_grid)  # 0: an exact tie, which the float32 quotient keeps exact
    sf_tie = np.broadcast_to((d > 0) & (d < 2.0**-20), xb.shape).reshape(shape)
    assert sf_tie.mean() < 1e-3
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(sf == 0, 0.0, xb / (sf * k)).reshape(shape)  # what the writer rounds to e2m1
    tie = (midpoint_distance(y, E2M1) < 2.0**-20) & ~sf_tie
    assert tie.mean() < 0.02
    exact = ~tie & ~sf_tie
    np.testing.assert_array_equal(got[exact], want[exact])
    block_scale = np.broadcast_to(sf, xb.shape).reshape(shape)
    j = np.abs(np.abs(y[tie])[:, None] - (E2M1[1:] + E2M1[:-1]) / 2).argmin(-1)  # the midpoint each tie sits at
    reads = [as_bfloat16(np.copysign(E2M1[j + side], xs[tie]) * block_scale[tie] * k) for side in (0, 1)]
    assert ((got[tie] == reads[0]) | (got[tie] == reads[1])).all()


def test_nvfp4_4over6_picks_max_over_4_only_when_strictly_better():
    """Block max 4, k = 1: /6 gives sf = e4m3(0.667) = 0.6875 and 4 reads back as 4.125; /4 gives sf = 1, exact.

    Block max 6 on the e2m1 grid: /6 (sf = 1) is exact, /4 (sf = 1.5) reads 0.5 back as 0.75, so /6 stays.
    """
    four = np.array([4, -4, 2, 1, 0.5, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, -2])
    six = np.array([6, 3, -1.5, 0.5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, -6])
    x = torch.tensor(np.concatenate([four, six]), dtype=torch.float32).view(1, 1, 1, 32)
    got = DTYPES["nvfp4_4over6"].round_trip(x, torch.tensor(1.0)).flatten().numpy()
    np.testing.assert_array_equal(got, x.flatten().numpy())  # both blocks come back exactly
    plain = DTYPES["nvfp4"].round_trip(x, torch.tensor(1.0)).flatten().numpy()
    assert plain[0] == 4.125 and (plain[16:] == six).all()  # nvfp4 alone keeps /6: the first block is off


# --- fp8_e5m2 -------------------------------------------------------------------------------------------------

def e5m2_codes() -> np.ndarray:
    """Value of each of the 256 e5m2 codes from its bit layout (bias 15, 2-bit mantissa), float64; ±Inf, NaN."""
    values = np.empty(256)
    for code in range(256):
        sign, exponent, mantissa = code >> 7, (code >> 2) & 0x1F, code & 0x3
        if exponent == 0:
            magnitude = mantissa / 4 * 2.0**-14
        elif exponent == 31:
            magnitude = np.inf if mantissa == 0 else np.nan
        else:
            magnitude = (1 + mantissa / 4) * 2.0 ** (exponent - 15)
        values[code] = -magnitude if sign else magnitude
    return values


def test_e5m2_format_constant_matches_its_codes():
    codes = e5m2_codes()
    np.testing.assert_array_equal(torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).double().numpy(), codes)
    finite = codes[np.isfinite(codes)]
    assert fp8.E5M2.max == finite.max() == 57344.0
    assert fp8.E5M2.min_subnormal == finite[finite > 0].min() and fp8.E5M2.min_normal == 2.0**-14
    assert "e5m2" not in fp8.FORMATS  # not a --fp8-format choice


def test_e5m2_codes_round_trip_to_themselves():
    codes = e5m2_codes()
    finite = codes[np.isfinite(codes)].astype(F32)
    got = DTYPES["fp8_e5m2"].round_trip(torch.from_numpy(finite), torch.tensor(1.0))
    np.testing.assert_array_equal(got.numpy(), finite)


@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0])
def test_e5m2_midpoints_round_to_even_code_and_saturate(scale):
    grid = e5m2_codes()[:124]  # non-negative finite values in code order
    mids = (grid[:-1] + grid[1:]) / 2
    even_neighbour = np.where(np.arange(len(mids)) % 2 == 1, grid[1:], grid[:-1])  # mid i lies between codes i, i+1
    big = np.array([57344.0, 57344 * 1.05, 61439.0, 61440.0, 1e6, np.inf])
    y = np.concatenate([mids, -mids, big, -big])
    want = np.concatenate([even_neighbour, -even_neighbour, np.full(6, 57344.0), np.full(6, -57344.0)]) * scale
    x = torch.from_numpy(y * scale).float()
    got = DTYPES["fp8_e5m2"].round_trip(x, torch.tensor(scale))
    np.testing.assert_array_equal(got.double().numpy(), want)


# --- sizes and the API ----------------------------------------------------------------------------------------

H, D = 8, 128
BYTES = {  # docs/kv-dtypes.md "B = ..." with H = 8, D = D_v = 128
    "auto": 4 * H * D, "fp8": 2 * H * D, "fp8_e5m2": 2 * H * D, "fp8_per_token_head": H * (2 * D + 8),
    "int8_per_token_head": H * (2 * D + 8), "int4_per_token_head": H * (D + 8), "nvfp4": 9 * H * D / 8,
    "nvfp4_4over6": 9 * H * D / 8, "turboquant_k8v4": 196 * H, "turboquant_4bit_nc": 134 * H,
    "turboquant_k3v4_nc": 118 * H, "turboquant_3bit_nc": 102 * H,
}
DV = 192  # a K/V head-size pair the Triton and FlashAttention layouts allow (e.g. MLA-style 192/128)
BYTES_DV = {  # H·(bytes of a K cell of D + a V cell of D_v)
    "auto": H * 2 * (D + DV), "fp8": H * (D + DV), "fp8_e5m2": H * (D + DV), "fp8_per_token_head": H * (D + 4 + DV + 4),
    "int8_per_token_head": H * (D + 4 + DV + 4), "int4_per_token_head": H * (D / 2 + 4 + DV / 2 + 4),
}


def test_every_dtype_listed_once_with_its_name():
    assert set(DTYPES) == set(BYTES)
    for name, dtype in DTYPES.items():
        assert dtype.name == name and dtype.scale in ("tensor", "token", "none") and dtype.note


@pytest.mark.parametrize("name", BYTES)
def test_bytes_per_token(name):
    assert DTYPES[name].bytes_per_token(H, D) == BYTES[name]
    assert DTYPES[name].bytes_per_token(H, D, D) == BYTES[name]
    if name in BYTES_DV:
        assert DTYPES[name].bytes_per_token(H, D, DV) == BYTES_DV[name]
    else:  # FlashInfer's nvfp4 and TurboQuant take one head size for K and V
        with pytest.raises(ValueError, match="head"):
            DTYPES[name].bytes_per_token(H, D, DV)


def test_turboquant_slot_rule_at_other_head_sizes():
    # D = 64: k8v4 64 + (32 + 4) = 100; 3bit_nc (24 + 2) + (24 + 4) = 54; D = 72, 3 bits: 27 + 2 + 27 + 4 = 60
    assert DTYPES["turboquant_k8v4"].bytes_per_token(1, 64) == 100
    assert DTYPES["turboquant_3bit_nc"].bytes_per_token(1, 64) == 54
    assert DTYPES["turboquant_3bit_nc"].bytes_per_token(1, 72) == 60
    assert DTYPES["turboquant_k3v4_nc"].bytes_per_token(1, 72) == 27 + 2 + 36 + 4 + 1  # 69, rounded up to even


def test_round_trip_errors_say_what_is_wrong():
    x = torch.randn(1, 2, 3, 32)
    for name in ("fp8", "fp8_e5m2", "nvfp4", "nvfp4_4over6"):
        with pytest.raises(ValueError, match="scale"):
            DTYPES[name].round_trip(x)
    with pytest.raises(NotImplementedError, match="turboquant_k8v4"):
        DTYPES["turboquant_k8v4"].round_trip(x)
    with pytest.raises(ValueError, match="multiple of 16"):
        DTYPES["nvfp4"].round_trip(torch.randn(1, 2, 3, 40), torch.tensor(1.0))
    with pytest.raises(ValueError, match="even"):
        DTYPES["int4_per_token_head"].round_trip(torch.randn(1, 2, 3, 7))


@pytest.mark.parametrize("name", [name for name, d in DTYPES.items() if d.emulate is not None])
def test_round_trip_keeps_shape_and_dtype_and_ignores_scale_when_per_token(name):
    x = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = DTYPES[name].round_trip(x, torch.tensor(0.05))
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    if DTYPES[name].scale != "tensor":
        assert torch.equal(got, DTYPES[name].round_trip(x))
