"""Tests for calibrate/capture/stats.py: bins, position buckets, ``update`` against brute-force float64
computations, exact merging, and the statistics file.

Every expected value is computed here from the raw tensors with numpy in float64: histograms with
``np.histogram`` over the bin edges, position buckets from ``int.bit_length``, the per-token FP8
error with the reference rounding of test_fp8.py (no torch FP8 conversion).
"""

import json
import math

import numpy as np
import pytest
import torch
from references import e4m3_codes, e4m3_round, tie_and_neighbour_values
from safetensors import safe_open
from safetensors.torch import save_file

from calibrate.capture.stats import (
    HIST_BINS_PER_OCTAVE,
    HIST_MAX_EXP,
    HIST_MIN_EXP,
    KINDS,
    NUM_BINS,
    NUM_POS_BUCKETS,
    SINK_POSITIONS,
    Stats,
    bin_edges,
    bin_index,
    position_bucket,
    position_bucket_starts,
    round_to_e4m3,
)
from calibrate.fp8 import FORMATS
from calibrate.model.layers import ModelSignature

F32_EPS = 2.0**-24  # unit roundoff of float32

# ---------------------------------------------------------------------------------------------------------------
# Bins


def _float32_test_values() -> np.ndarray:
    """Float32 normals across (and beyond) the histogram range: every bin edge, the float32 just below
    each edge, powers of two, and log-uniform random values."""
    rng = np.random.default_rng(0)
    edges = bin_edges()[2:-1, 0].numpy().astype(np.float32)  # lower edges of the regular bins
    below = np.nextafter(edges, np.float32(0))
    randoms = np.exp2(rng.uniform(-60, 40, 200_000)).astype(np.float32)
    powers = np.exp2(np.arange(-126, 128, dtype=np.float64)).astype(np.float32)
    return np.concatenate([edges, below, randoms, powers, [np.float32(2.0**HIST_MAX_EXP)], [np.float32(3e38)]])


@pytest.mark.smoke
def test_bin_edges_layout():
    edges = bin_edges().numpy()
    assert edges.shape == (NUM_BINS, 2)
    assert edges[0].tolist() == [0.0, 0.0]  # exact zeros
    assert edges[1].tolist() == [0.0, 2.0**HIST_MIN_EXP]  # underflow
    assert edges[-1].tolist() == [2.0**HIST_MAX_EXP, math.inf]  # overflow
    regular = edges[2:-1]
    assert regular.shape[0] == (HIST_MAX_EXP - HIST_MIN_EXP) * HIST_BINS_PER_OCTAVE
    np.testing.assert_array_equal(regular[1:, 0], regular[:-1, 1])  # contiguous
    assert regular[0, 0] == 2.0**HIST_MIN_EXP and regular[-1, 1] == 2.0**HIST_MAX_EXP
    relative_width = regular[:, 1] / regular[:, 0] - 1
    assert relative_width.max() == pytest.approx(1 / HIST_BINS_PER_OCTAVE)  # at most 1/32 of a value
    assert relative_width.min() == pytest.approx(1 / (2 * HIST_BINS_PER_OCTAVE - 1))


def test_every_value_lies_in_its_bin():
    v = _float32_test_values()
    idx = bin_index(torch.from_numpy(v)).numpy()
    edges = bin_edges().numpy()[idx]
    v64 = v.astype(np.float64)
    regular = (idx >= 2) & (idx < NUM_BINS - 1)
    assert regular.sum() > 100_000
    assert ((edges[regular, 0] <= v64[regular]) & (v64[regular] < edges[regular, 1])).all()
    assert (idx[v64 < 2.0**HIST_MIN_EXP] == 1).all()  # underflow
    assert (idx[v64 >= 2.0**HIST_MAX_EXP] == NUM_BINS - 1).all()  # overflow
    assert (idx[(v64 >= 2.0**HIST_MIN_EXP) & (v64 < 2.0**HIST_MAX_EXP)] >= 2).all()


@pytest.mark.parametrize(
    "value, expected_bin",
    [(0.0, 0), (-0.0, 0), (2.0**-126, 1), (2.0**-41, 1), (float("inf"), NUM_BINS - 1), (float("nan"), NUM_BINS - 1)],
    ids=["zero", "negative_zero", "smallest_normal", "below_range", "inf", "nan"],
)
def test_special_values_bin(value, expected_bin):
    assert bin_index(torch.tensor([value])).item() == expected_bin


def test_float32_subnormals_below_2_pow_131_count_as_zero_and_the_rest_as_underflow():
    """As documented: bits >> 18 == 0 means below 2**-131, which no FP8 scale can tell from zero."""
    assert (bin_index(torch.tensor([1e-45, 1e-40, 2.0**-135])) == 0).all()
    assert (bin_index(torch.tensor([2.0**-131, 1e-30, 2.0**-41])) == 1).all()


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_fp8_value_is_a_bin_edge(name):
    """The module's promise: bin edges include every e4m3 value, so bins never straddle an FP8 value."""
    codes = e4m3_codes(name)
    values = np.unique(codes[np.isfinite(codes) & (codes >= 2.0**HIST_MIN_EXP)])
    idx = bin_index(torch.from_numpy(values).float())
    np.testing.assert_array_equal(bin_edges()[idx, 0].numpy(), values)


@pytest.mark.parametrize("values", ["ties_and_neighbours", "log_uniform"])
def test_round_to_e4m3_equals_reference(values):
    """The bit-trick rounding used for the per-token error, on every tie of e4m3fn and around it."""
    if values == "ties_and_neighbours":
        x = tie_and_neighbour_values("e4m3fn")
    else:
        rng = np.random.default_rng(4)
        x = (np.exp2(rng.uniform(-16, np.log2(448), 100_000)) * rng.choice([-1, 1], 100_000)).astype(np.float32)
    got = round_to_e4m3(torch.from_numpy(x)).double().numpy()
    np.testing.assert_array_equal(got, e4m3_round(x.astype(np.float64), "e4m3fn"))


def _bucket_reference(p: int) -> int:
    p = int(p)
    return p if p < SINK_POSITIONS else min(p.bit_length() - 1 + 2, NUM_POS_BUCKETS - 1)


def test_position_bucket_matches_bit_length():
    positions = list(range(0, 5000)) + [2**e + d for e in range(12, 26) for d in (-1, 0, 1)]
    got = position_bucket(torch.tensor(positions)).tolist()
    assert got == [_bucket_reference(p) for p in positions]


def test_position_bucket_starts():
    starts = position_bucket_starts()
    assert len(starts) == NUM_POS_BUCKETS and starts[:5] == [0, 1, 2, 3, 4]
    for i, start in enumerate(starts):
        assert _bucket_reference(start) == i
        if i + 1 < len(starts):
            assert _bucket_reference(starts[i + 1] - 1) == i


# ---------------------------------------------------------------------------------------------------------------
# Stats.update against brute force

L, HKV, HQ, D = 2, 2, 4, 16

CASES = {  # name → (batch start positions, sequence length)
    "from_position_0": ([0], 64),
    "chunk_at_1000": ([1000], 48),
    "batch_of_two": ([0, 5000], 40),
    "past_last_bucket": ([3_000_000], 16),  # positions ≥ 2**21 share the last bucket
}


def _signature(**changes) -> ModelSignature:
    fields = dict(model_type="llama", layers=[3, 7], num_kv_heads=HKV, num_heads=HQ, head_dim=D)
    fields.update(changes)
    return ModelSignature(**fields)


def _tensor(gen: torch.Generator, B: int, H: int, S: int, positions: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] float32 with what real K/V/Q show and what the bins must handle: per-head scales,
    an outlier channel, large sink tokens, exact zeros, values below and above the histogram's range,
    values exactly on bin edges."""
    x = torch.randn(B, H, S, D, generator=gen) * torch.logspace(-2, 1, H).view(1, H, 1, 1)
    x[..., 3] *= 20  # an outlier channel
    x = torch.where((positions < SINK_POSITIONS).view(B, 1, S, 1), x * 50, x)  # sink tokens
    x[:, :, 1::7, 0] = 0.0  # exact zeros
    x[:, 0, 2::11, 1] = 3e-13  # below 2**-40: the underflow bin
    x[:, -1, 5, 2] = -4e7  # above 2**24: the overflow bin
    x[:, :, 6, 4:8] = torch.tensor([1.0, 1.03125, -448.0, 2.0**-6])  # on bin edges
    return x


def _make_inputs(starts: list[int], S: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor(starts).view(-1, 1) + torch.arange(S)  # [B, S]
    B = len(starts)
    q, k, v = (_tensor(gen, B, H, S, positions) for H in (HQ, HKV, HKV))
    return q, k, v, positions


def _hist_reference(a: np.ndarray) -> np.ndarray:
    """|x| (float64, any shape) → counts per bin [NUM_BINS], via np.histogram over the regular edges."""
    edges = bin_edges().numpy()
    regular_edges = np.append(edges[2:-1, 0], 2.0**HIST_MAX_EXP)
    a = a.ravel()
    in_range = (a >= 2.0**HIST_MIN_EXP) & (a < 2.0**HIST_MAX_EXP)
    counts = np.zeros(NUM_BINS, dtype=np.int64)
    counts[0] = (a == 0).sum()
    counts[1] = ((a > 0) & (a < 2.0**HIST_MIN_EXP)).sum()
    counts[2:-1] = np.histogram(a[in_range], bins=regular_edges)[0]
    counts[-1] = (~(a < 2.0**HIST_MAX_EXP)).sum()  # includes Inf and NaN
    return counts


def _token_sqerr_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's fp8_per_token_head squared error per head, float64: scale = max(token absmax / 448, 1e-6).

    Also returns how far a float32 evaluation may be from it: there, x / scale carries a few float32
    roundings, moving each dequantized value by up to δ = 8·u·scale·448 per token; the squared error
    of D values then moves by at most 2·δ·sqrt(D·err) + D·δ² (Cauchy-Schwarz). A rounding that flips
    between float32 and float64 sits at a tie, where both choices have about the same error.
    """
    scale = np.maximum(np.abs(x).max(-1, keepdims=True) / 448.0, 1e-6)  # [B, H, S, 1]
    q = e4m3_round(x / scale, "e4m3fn") * scale
    err = ((q - x) ** 2).sum(-1)  # [B, H, S]
    delta = 8 * F32_EPS * scale[..., 0] * 448.0  # [B, H, S]
    slack = 2 * delta * np.sqrt(x.shape[-1] * err) + x.shape[-1] * delta**2
    return err.sum((0, 2)), slack.sum((0, 2))


def _reference(x: torch.Tensor, positions: torch.Tensor, token_error: bool) -> dict[str, np.ndarray]:
    """Every TensorStats field for one update, per head, from float64 brute force."""
    x = x.double().numpy()  # [B, H, S, D]
    B, H, S, _ = x.shape
    a = np.abs(x)
    pos = positions.numpy()
    buckets = np.vectorize(_bucket_reference)(pos)  # [B, S]
    tok_amax = a.max(-1)  # [B, H, S]
    tok_sumsq = (x * x).sum(-1)  # [B, H, S]
    ref = {
        "absmax": a.max((0, 2, 3)),
        "sum": x.sum((0, 2, 3)),
        "sumsq": tok_sumsq.sum((0, 2)),
        "hist": np.stack([_hist_reference(a[:, h]) for h in range(H)]),
        "token_hist": np.stack([_hist_reference(tok_amax[:, h]) for h in range(H)]),
        "sink_hist": np.stack([_hist_reference(a[:, h][pos < SINK_POSITIONS]) for h in range(H)]),
        "pos_absmax": np.zeros((H, NUM_POS_BUCKETS)),
        "pos_sumsq": np.zeros((H, NUM_POS_BUCKETS)),
        "channel_absmax": a.max((0, 2)),
        "nonfinite": (~np.isfinite(x).all(-1)).sum((0, 2)),
        "token_sqerr": _token_sqerr_reference(x)[0] if token_error else np.zeros(H),
        "token_sqerr_slack": _token_sqerr_reference(x)[1] if token_error else np.zeros(H),
        # for tolerances, not fields:
        "abs_sum": a.sum((0, 2, 3)),
    }
    for b in range(B):
        for s in range(S):
            p = buckets[b, s]
            ref["pos_absmax"][:, p] = np.maximum(ref["pos_absmax"][:, p], tok_amax[b, :, s])
            ref["pos_sumsq"][:, p] += tok_sumsq[b, :, s]
    return ref


@pytest.fixture(scope="module", params=list(CASES))
def updated(request):
    """(stats after one update of row 1, the inputs, the case's name)."""
    starts, S = CASES[request.param]
    q, k, v, positions = _make_inputs(starts, S)
    stats = Stats.empty(_signature())
    stats.update(1, q, k, v, positions)
    return stats, {"q": q, "k": k, "v": v}, positions


@pytest.mark.parametrize("kind", KINDS)
def test_update_matches_brute_force(updated, kind):
    stats, inputs, positions = updated
    s = stats.kinds[kind]
    ref = _reference(inputs[kind], positions, token_error=kind != "q")
    row = 1
    # Maxima and counts: exact.
    np.testing.assert_array_equal(s.absmax[row].numpy(), ref["absmax"])
    np.testing.assert_array_equal(s.channel_absmax[row].numpy(), ref["channel_absmax"])
    np.testing.assert_array_equal(s.pos_absmax[row].numpy(), ref["pos_absmax"])
    for name in ("hist", "token_hist", "sink_hist", "nonfinite"):
        np.testing.assert_array_equal(s.__dict__[name][row].numpy(), ref[name], err_msg=name)
    # Moments: float32 partial sums are allowed inside one update; the bounds are those of float32
    # summation of n terms, (n − 1)·u relative for positive terms, (n − 1)·u·Σ|x| absolute for signed ones.
    n_tokens = positions.numel()
    np.testing.assert_allclose(s.sumsq[row].numpy(), ref["sumsq"], rtol=D * F32_EPS)
    np.testing.assert_allclose(s.pos_sumsq[row].numpy(), ref["pos_sumsq"], rtol=(D + n_tokens) * F32_EPS)
    assert (np.abs(s.sum[row].numpy() - ref["sum"]) <= (D + n_tokens) * F32_EPS * ref["abs_sum"]).all()
    # Per-token FP8 error: float32 there, float64 here (the slack is explained in _token_sqerr_reference).
    got, want = s.token_sqerr[row].numpy(), ref["token_sqerr"]
    assert (np.abs(got - want) <= 1e-6 * want + ref["token_sqerr_slack"]).all(), (got, want, ref["token_sqerr_slack"])
    if kind != "q":
        assert (ref["token_sqerr"] > 0).all()
    # Dtypes as documented; row 0 untouched.
    assert s.absmax.dtype == torch.float32 and s.sum.dtype == torch.float64 and s.hist.dtype == torch.int64
    for name, value in s.__dict__.items():
        assert (value[0] == 0).all(), name


def test_update_counts_tokens_and_position_buckets(updated):
    stats, _, positions = updated
    assert stats.tokens.tolist() == [0, positions.numel()]
    want = np.bincount(np.vectorize(_bucket_reference)(positions.numpy()).ravel(), minlength=NUM_POS_BUCKETS)
    np.testing.assert_array_equal(stats.pos_tokens[1].numpy(), want)
    assert (stats.pos_tokens[0] == 0).all()
    for kind, H in (("k", HKV), ("v", HKV), ("q", HQ)):
        assert stats.kinds[kind].count[1].tolist() == [positions.numel() * D] * H


def test_update_counts_non_finite_rows():
    q, k, v, positions = _make_inputs([0], 20)
    k[0, 0, 3, 5] = float("nan")
    k[0, 0, 3, 6] = float("inf")  # same (token, head) row: counted once
    k[0, 1, 9, 0] = -float("inf")
    v[0, 1, 2, 2] = float("nan")
    stats = Stats.empty(_signature())
    stats.update(0, q, k, v, positions)
    assert stats.kinds["k"].nonfinite[0].tolist() == [1, 1]
    assert stats.kinds["v"].nonfinite[0].tolist() == [0, 1]
    assert stats.kinds["q"].nonfinite[0].tolist() == [0] * HQ
    assert stats.kinds["k"].hist[0, 0, -1] >= 2  # NaN and Inf land in the overflow bin
    assert torch.isnan(stats.kinds["k"].absmax[0, 0]) or torch.isinf(stats.kinds["k"].absmax[0, 0])


# ---------------------------------------------------------------------------------------------------------------
# Merging

EXACT = ("absmax", "hist", "token_hist", "sink_hist", "pos_absmax", "channel_absmax", "nonfinite")
MOMENTS = ("sum", "sumsq", "pos_sumsq", "token_sqerr")


def _assert_stats_equal(a: Stats, b: Stats, rtol: float, pos_sumsq_rtol: float | None = None) -> None:
    np.testing.assert_array_equal(a.tokens.numpy(), b.tokens.numpy())
    np.testing.assert_array_equal(a.pos_tokens.numpy(), b.pos_tokens.numpy())
    for kind in KINDS:
        sa, sb = a.kinds[kind], b.kinds[kind]
        for name in EXACT:
            np.testing.assert_array_equal(getattr(sa, name).numpy(), getattr(sb, name).numpy(), err_msg=f"{kind}.{name}")
        for name in MOMENTS:
            tol = pos_sumsq_rtol if name == "pos_sumsq" and pos_sumsq_rtol is not None else rtol
            np.testing.assert_allclose(getattr(sa, name).numpy(), getattr(sb, name).numpy(), rtol=tol, atol=0, err_msg=f"{kind}.{name}")


@pytest.mark.parametrize("split", ["along_sequence", "along_batch"])
def test_merge_of_halves_equals_whole(split):
    q, k, v, positions = _make_inputs([0, 5000], 64, seed=3)
    whole = Stats.empty(_signature())
    whole.update(0, q, k, v, positions)
    whole.update(1, q * 2, k * 2, v * 2, positions)
    halves = []
    for part in (slice(0, 32), slice(32, 64)) if split == "along_sequence" else (slice(0, 1), slice(1, 2)):
        cut = (lambda t, p=part: t[..., p, :]) if split == "along_sequence" else (lambda t, p=part: t[p])
        cut_pos = positions[:, part] if split == "along_sequence" else positions[part]
        stats = Stats.empty(_signature())
        stats.update(0, cut(q), cut(k), cut(v), cut_pos)
        stats.update(1, cut(q) * 2, cut(k) * 2, cut(v) * 2, cut_pos)
        halves.append(stats)
    merged = halves[0].merge_(halves[1])
    assert merged is halves[0]
    # Counts and maxima exactly; float64 moments up to the order of additions. pos_sumsq is summed over the
    # tokens of one update in float32 (capture/stats.py trades that for speed), so it merges to float32 precision only.
    _assert_stats_equal(merged, whole, rtol=1e-12, pos_sumsq_rtol=positions.numel() * F32_EPS)


def test_merge_refuses_another_model():
    a, b = Stats.empty(_signature()), Stats.empty(_signature(num_kv_heads=1))
    with pytest.raises(ValueError, match="num_kv_heads"):
        a.merge_(b)


@pytest.mark.parametrize(
    "field, value",
    [("model_type", "qwen2"), ("layers", [3, 8]), ("num_kv_heads", 4), ("num_heads", 8), ("head_dim", 32)],
)
def test_signature_mismatch_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field} is .* in the statistics but .* in the model"):
        _signature().check_matches(_signature(**{field: value}))
    _signature().check_matches(_signature())  # equal: no error


# ---------------------------------------------------------------------------------------------------------------
# The statistics file


@pytest.fixture
def saved(tmp_path):
    q, k, v, positions = _make_inputs([0, 1000], 24, seed=5)
    stats = Stats.empty(_signature())
    stats.update(0, q, k, v, positions)
    stats.update(1, q, k, v, positions + 24)
    stats.meta = {"model": "/some/model", "tokens": 48, "data": [{"source": "x.jsonl"}]}
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    return stats, path


def test_save_load_round_trip(saved):
    stats, path = saved
    loaded = Stats.load(path)
    assert loaded.signature == stats.signature
    assert loaded.meta == stats.meta
    _assert_stats_equal(loaded, stats, rtol=0)
    for kind in KINDS:
        for name, value in stats.kinds[kind].__dict__.items():
            assert getattr(loaded.kinds[kind], name).dtype == value.dtype


def _rewrite(path, out, *, header_changes=None, tensor_changes=None):
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["kvcal"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    header.update(header_changes or {})
    tensors.update(tensor_changes or {})
    save_file(tensors, str(out), metadata={"kvcal": json.dumps(header)})
    return out


def test_load_refuses_file_without_kvcal_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"tokens": torch.zeros(2, dtype=torch.int64)}, str(path))
    with pytest.raises(ValueError, match="not a kvcal statistics file"):
        Stats.load(path)


@pytest.mark.parametrize(
    "changes",
    [{"format_version": 99}, {"hist": [16, HIST_MIN_EXP, HIST_MAX_EXP]}, {"hist": [32, -30, HIST_MAX_EXP]}],
    ids=["format_version", "bins_per_octave", "hist_range"],
)
def test_load_refuses_other_layout(saved, tmp_path, changes):
    _, path = saved
    bad = _rewrite(path, tmp_path / "bad.safetensors", header_changes=changes)
    with pytest.raises(ValueError, match="incompatible kvcal version; recalibrate"):
        Stats.load(bad)


def test_load_refuses_tensor_of_wrong_shape(saved, tmp_path):
    stats, path = saved
    wrong = stats.kinds["k"].hist[:, :1].contiguous()  # one head instead of two
    bad = _rewrite(path, tmp_path / "bad.safetensors", tensor_changes={"k.hist": wrong})
    with pytest.raises(ValueError, match=r"k\.hist has shape \(2, 1, \d+\)"):
        Stats.load(bad)


def test_load_refuses_signature_that_disagrees_with_tensors(saved, tmp_path):
    _, path = saved
    with safe_open(str(path), "pt") as f:
        signature = json.loads(f.metadata()["kvcal"])["signature"]
    bad = _rewrite(path, tmp_path / "bad.safetensors", header_changes={"signature": {**signature, "head_dim": 8}})
    with pytest.raises(ValueError, match="channel_absmax has shape"):
        Stats.load(bad)


def test_load_missing_file_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvcal output directory"):
        Stats.load(tmp_path / "nothing.safetensors")
