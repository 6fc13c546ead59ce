"""Tests for calibrate/scales/observers.py: every observer and prediction against brute force on the actual samples.

Statistics are collected with the real ``TensorStats.update`` from synthetic tensors of known
distributions; every expected number is computed here from the samples themselves, in float64, with
the reference FP8 rounding of test_fp8.py (no torch FP8 conversion). Tolerances, and why:

- saturation and underflow fractions: ``predict`` splits the one bin that holds the threshold
  assuming values are uniform inside it, so it can be off by at most that bin's count / n (checked
  exactly that way).
- percentile: the observer returns the upper edge of the bin holding the k-th smallest |x|
  (k = ceil(n·p/100), numpy's ``inverted_cdf``), so it lies in [a_k, a_k·(1 + 1/32)]: bins are at
  most 1/32 of their value wide. numpy's default (linear) percentile interpolates between order
  statistics at rank (n − 1)·p/100 ≤ k, so it is never above the observer's value; in a sparse tail
  (p = 99.99 of 16k values) it can be more than a bin below, because the order statistics are.
- relative MSE: ``predict`` integrates each bin with 4 stratified samples, assuming a uniform
  density inside the bin. For smooth densities with many values per bin this is good to about 1%
  (measured); 3% is allowed. It is not checked where a handful of values carry the error.
- mse: its search is over scales absmax/448 × 2**(−j/16), so it can only be as good as the best of
  those; a brute-force search over a 32× finer grid on the actual samples bounds how much that costs.
  Where a dozen outliers carry the error, the brute force finds a scale that happens to put them
  near FP8 values, which no histogram can see: there the bound is loose.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from references import e4m3_quantize_dequantize

from calibrate.capture.stats import SINK_POSITIONS, TensorStats, bin_index, position_bucket
from calibrate.choices import GRANULARITIES, OBSERVERS
from calibrate.fp8 import FORMATS, SCALE_FLOOR
from calibrate.scales.observers import (
    ObserverSpec,
    derive_scales,
    observe,
    parse_granularity,
    parse_observer,
    predict,
    sink_saturation,
    token_rel_mse,
)

E4M3 = FORMATS["e4m3fn"]
H, S, D = 2, 512, 32  # heads, positions, head_dim: 16384 values per head


def _collect(*layers: np.ndarray, positions: np.ndarray | None = None) -> TensorStats:
    """Statistics of one [1, H, S, D] float32 array per layer, through the real capture update."""
    shape = layers[0].shape
    stats = TensorStats.zeros(len(layers), shape[1], shape[3])
    pos = torch.from_numpy(np.arange(shape[2]) if positions is None else positions).view(1, -1)  # [1, S]
    for row, x in enumerate(layers):
        stats.update(row, torch.from_numpy(x), position_bucket(pos), pos < SINK_POSITIONS, token_error=True)
    return stats


def _data(kind: str, seed: int = 0) -> np.ndarray:
    """[1, H, S, D] float32 samples of a named distribution (head 1 five times larger than head 0)."""
    rng = np.random.default_rng(seed)
    size = (1, H, S, D)
    if kind == "gaussian":
        x = rng.standard_normal(size)
    elif kind == "laplace":
        x = rng.laplace(size=size)
    elif kind == "heavy_outliers":  # a few values 1000× the bulk
        x = rng.standard_normal(size)
        idx = rng.choice(x.size, 12, replace=False)
        x.flat[idx] = 1000 * rng.uniform(0.5, 1.0, 12) * rng.choice([-1, 1], 12)
    elif kind == "lone_outlier":  # uniform bulk, one value 1.45× its edge: worth clipping
        x = rng.uniform(-1, 1, size)
        x[0, :, 7, 3] = 1.45
    elif kind == "tiny":  # ~1e-9 (head 1: 5e-9): at the scale floor these are subnormal in FP8
        x = rng.standard_normal(size) * 1e-9
    elif kind == "zero":
        x = np.zeros(size)
    else:
        raise ValueError(kind)
    x[0, 1] *= 5
    return x.astype(np.float32)


def _pooled(x: np.ndarray, per_head: bool) -> list[np.ndarray]:
    """The samples behind each scale: one array per head, or one for the whole layer."""
    return [x[0, h].ravel() for h in range(x.shape[1])] if per_head else [x.ravel()]


def _true_cost(x: np.ndarray, scale: float, fmt=E4M3) -> dict[str, float]:
    """Brute force on the samples: saturated and underflow fractions, relative squared error."""
    a = np.abs(x.astype(np.float64))
    s = float(np.float32(scale))
    err = ((e4m3_quantize_dequantize(x, s, fmt.name) - x.astype(np.float64)) ** 2).sum()
    return {
        "saturated": float((a > fmt.max * s).mean()),
        "underflow": float(((a > 0) & (a < fmt.min_normal * s)).mean()),
        "rel_mse": float(err / max((x.astype(np.float64) ** 2).sum(), 1e-300)),
        "sqerr": float(err),
    }


def _one_bin_bound(x: np.ndarray, threshold: float) -> float:
    """Share of the samples in the histogram bin that holds ``threshold`` (1e-7: float32 output)."""
    b = bin_index(torch.tensor([threshold])).item()
    return float((bin_index(torch.from_numpy(np.abs(x))) == b).float().mean()) + 1e-7


def _observe(stats: TensorStats, observer: str, per_head: bool, fmt=E4M3, headroom: float = 1.0):
    return observe(stats, parse_observer(observer), fmt, per_head=per_head, headroom=headroom)


GRANULARITY = {"per_tensor": False, "per_head": True}


# ---------------------------------------------------------------------------------------------------------------
# max


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("granularity", list(GRANULARITY))
@pytest.mark.parametrize("kind", ["gaussian", "heavy_outliers", "tiny"])
def test_max_is_absmax_over_format_max(kind, granularity, fmt_name):
    fmt, per_head = FORMATS[fmt_name], GRANULARITY[granularity]
    x = _data(kind)
    scale, _ = _observe(_collect(x), "max", per_head, fmt)
    assert scale.shape == ((1, H) if per_head else (1,)) and scale.dtype == torch.float32
    want = [np.float32(max(np.abs(v.astype(np.float64)).max() / fmt.max, SCALE_FLOOR)) for v in _pooled(x, per_head)]
    np.testing.assert_array_equal(scale.flatten().numpy(), want)


# ---------------------------------------------------------------------------------------------------------------
# percentile


@pytest.mark.parametrize("granularity", list(GRANULARITY))
@pytest.mark.parametrize("kind", ["gaussian", "laplace", "heavy_outliers"])
@pytest.mark.parametrize("p", [50, 99, 99.9, 99.99, 100])
def test_percentile_within_one_bin_of_numpy(kind, granularity, p):
    per_head = GRANULARITY[granularity]
    x = _data(kind)
    scale, _ = _observe(_collect(x), f"percentile:{p}", per_head)
    value = scale.flatten().double().numpy() * 448.0
    for got, v in zip(value, _pooled(x, per_head)):
        a = np.abs(v.astype(np.float64))
        kth = np.percentile(a, p, method="inverted_cdf")  # the ceil(n·p/100)-th smallest |x|
        assert kth * (1 - 2**-23) <= got <= kth * (1 + 1 / 32) * (1 + 2**-23)
        assert np.percentile(a, p) * (1 - 2**-23) <= got  # numpy's default (linear): never above
    if p == 100:
        np.testing.assert_array_equal(scale.numpy(), _observe(_collect(x), "max", per_head)[0].numpy())


# ---------------------------------------------------------------------------------------------------------------
# mse


def _brute_force_best(v: np.ndarray) -> tuple[float, float]:
    """Least squared error over scales absmax/448 × 2**(−i/512), i < 8·512, on the actual samples:
    every 16th i first, then each i around the best 8 (the function is smooth at that step)."""
    base = np.abs(v.astype(np.float64)).max() / 448.0
    coarse = np.arange(0, 8 * 512, 16)
    errs = [_true_cost(v, base * 2.0 ** (-i / 512))["sqerr"] for i in coarse]
    best_i = coarse[int(np.argmin(errs))]
    fine = np.arange(max(best_i - 32, 0), best_i + 33)
    fine_errs = [_true_cost(v, base * 2.0 ** (-i / 512))["sqerr"] for i in fine]
    return float(min(min(errs), min(fine_errs))), float(base * 2.0 ** (-fine[int(np.argmin(fine_errs))] / 512))


# kind → (how far above the brute-force best the mse scale's true error may be, measured now)
MSE_CASES = {
    "gaussian": 0.03,  # measured 0.9% (max: 1.5%)
    "laplace": 0.03,  # measured 0.0%
    "heavy_outliers": 0.50,  # measured 36%, max too: a dozen values carry the error (see the module docstring)
    "lone_outlier": 0.03,  # measured 0.5% (max: 25%)
}


@pytest.mark.parametrize("kind", list(MSE_CASES))
def test_mse_scale_is_near_brute_force_best(kind):
    x = _data(kind)
    scale, _ = _observe(_collect(x), "mse", per_head=False)
    v = x.ravel()
    best_err, best_scale = _brute_force_best(v)
    got = _true_cost(v, scale.item())["sqerr"]
    assert best_err <= got <= best_err * (1 + MSE_CASES[kind]), (got / best_err, scale.item(), best_scale)


@pytest.mark.parametrize("kind", list(MSE_CASES))
def test_mse_search_finds_the_best_of_its_candidates(kind):
    """The coarse-to-fine search against trying all 128 candidates absmax/448 × 2**(−j/16) with ``predict``."""
    stats = _collect(_data(kind))
    hist, absmax, sumsq = stats.hist.sum(1), stats.absmax.amax(1), stats.sumsq.sum(1)
    scale, pred = _observe(stats, "mse", per_head=False)
    candidates = absmax.double() / 448 * 2.0 ** (-torch.arange(128, dtype=torch.float64) / 16)
    exhaustive = min(predict(hist, absmax, sumsq, c.view(1).float(), E4M3).rel_mse.item() for c in candidates)
    assert exhaustive <= pred.rel_mse.item() <= exhaustive * 1.01
    j = -16 * math.log2(scale.item() * 448 / absmax.item())
    assert abs(j - round(j)) < 1e-3 and 0 <= round(j) < 128  # one of the candidates


@pytest.mark.smoke
def test_never_observed_layer_gets_floor():
    stats = TensorStats.zeros(2, H, D)  # no update at all
    for observer in ("max", "percentile:99.9", "mse", "sink-aware"):
        for per_head in (False, True):
            scale, pred = _observe(stats, observer, per_head)
            assert (scale == np.float32(SCALE_FLOOR)).all() and (pred.rel_mse == 0).all()


def test_mse_per_head_scales_are_each_heads_own():
    x = _data("lone_outlier")
    per_head, _ = _observe(_collect(x), "mse", per_head=True)
    alone = [_observe(_collect(x[:, h : h + 1]), "mse", per_head=True)[0].item() for h in range(H)]
    np.testing.assert_array_equal(per_head[0].numpy(), np.float32(alone))


@pytest.mark.parametrize("kind, must_beat_by", [("lone_outlier", 0.15), ("heavy_outliers", 0.0), ("gaussian", 0.0)])
def test_mse_never_worse_than_max_and_beats_it_when_clipping_pays(kind, must_beat_by):
    """Clipping a lone value just past the bulk pays off; clipping values 1000× the bulk never does in
    squared error (each clipped value costs its excess squared, far above FP8's relative rounding of
    the bulk), so there mse keeps max's scale or one within a rounding ripple of it."""
    x = _data(kind)
    stats = _collect(x)
    (s_mse, p_mse), (s_max, p_max) = _observe(stats, "mse", False), _observe(stats, "max", False)
    assert s_mse.item() <= s_max.item()
    assert p_mse.rel_mse.item() <= p_max.rel_mse.item()  # on its own objective, by construction
    true_mse, true_max = _true_cost(x.ravel(), s_mse.item())["sqerr"], _true_cost(x.ravel(), s_max.item())["sqerr"]
    assert true_mse <= true_max * (1 - must_beat_by) * (1 + 1e-3)


@pytest.mark.parametrize("observer", ["max", "percentile:99.9", "mse", "sink-aware"])
def test_no_scale_below_the_floor(observer):
    """SCALE_FLOOR is the smallest scale kvcal writes: mse's search must not step under it on tiny data."""
    scale, _ = _observe(_collect(_data("tiny")), observer, per_head=True)
    assert (scale == np.float32(SCALE_FLOOR)).all()


# ---------------------------------------------------------------------------------------------------------------
# predict


# (data, observer): scales that saturate, that do not, and that underflow most values
PREDICT_CASES = [
    ("gaussian", "max"),
    ("gaussian", "percentile:99"),
    ("laplace", "percentile:99.9"),
    ("laplace", "mse"),
    ("lone_outlier", "mse"),
    ("heavy_outliers", "percentile:99.9"),
    ("tiny", "max"),
]


@pytest.mark.parametrize("granularity", list(GRANULARITY))
@pytest.mark.parametrize("kind, observer", PREDICT_CASES)
def test_predict_matches_brute_force(kind, observer, granularity):
    per_head = GRANULARITY[granularity]
    x = _data(kind)
    scale, pred = _observe(_collect(x), observer, per_head)
    for i, v in enumerate(_pooled(x, per_head)):
        s = scale.flatten()[i].item()
        true = _true_cost(v, s)
        for name, threshold in (("saturated", E4M3.max * s), ("underflow", E4M3.min_normal * s)):
            got = getattr(pred, name).flatten()[i].item()
            assert abs(got - true[name]) <= _one_bin_bound(v, threshold), (name, got, true[name])
        if kind != "heavy_outliers":  # a dozen values carry the error there: see the module docstring
            assert pred.rel_mse.flatten()[i].item() == pytest.approx(true["rel_mse"], rel=0.03)  # measured ≤ 1.4%
    if observer.startswith("percentile:99"):
        assert (pred.saturated > 0).all()
    if kind == "tiny":  # the floor scale: values of 1e-8 are far below 2**-6 × 1e-6
        assert scale.flatten()[0].item() == np.float32(SCALE_FLOOR)
        assert (pred.underflow > 0.99).all()


def test_predict_on_values_it_saturates_heavily():
    """A scale far too small: most values clip, and the error is the clipping."""
    x = _data("gaussian")
    stats = _collect(x)
    scale = torch.tensor([0.5 / 448])  # clips |x| > 0.5
    pred = predict(stats.hist.sum(1), stats.absmax.amax(1), stats.sumsq.sum(1), scale, E4M3)
    true = _true_cost(x.ravel(), scale.item())
    assert pred.saturated.item() == pytest.approx(true["saturated"], abs=_one_bin_bound(x.ravel(), 0.5))
    assert pred.rel_mse.item() == pytest.approx(true["rel_mse"], rel=0.03)
    assert true["saturated"] > 0.5


# ---------------------------------------------------------------------------------------------------------------
# all-zero layers, headroom, shapes


@pytest.mark.parametrize("observer", ["max", "percentile:99.9", "mse", "sink-aware"])
@pytest.mark.parametrize("granularity", list(GRANULARITY))
def test_all_zero_layer_gets_floor_and_others_are_untouched(observer, granularity):
    per_head = GRANULARITY[granularity]
    live = _data("gaussian")
    stats = _collect(live, _data("zero"))  # layer 1 all zero
    scale, pred = _observe(stats, observer, per_head)
    assert (scale[1] == np.float32(SCALE_FLOOR)).all()
    for name in ("saturated", "underflow", "rel_mse"):
        assert (getattr(pred, name)[1] == 0).all()
    alone, _ = _observe(_collect(live), observer, per_head)
    np.testing.assert_array_equal(scale[0].numpy(), alone[0].numpy())  # layer rows are independent
    assert torch.isfinite(scale).all() and (scale > 0).all()


@pytest.mark.parametrize("observer", ["max", "percentile:99.9", "mse", "sink-aware"])
@pytest.mark.parametrize("headroom", [2.0, 1.3])
def test_headroom_multiplies(observer, headroom):
    stats = _collect(_data("laplace"))
    plain, _ = _observe(stats, observer, per_head=True)
    more, pred = _observe(stats, observer, per_head=True, headroom=headroom)
    np.testing.assert_allclose(more.numpy(), plain.numpy() * headroom, rtol=2**-23)
    if headroom == 2.0:
        np.testing.assert_array_equal(more.numpy(), plain.numpy() * 2)  # exact in binary
    again = predict(stats.hist, stats.absmax, stats.sumsq, more, E4M3)  # the prediction is of the final scale
    np.testing.assert_array_equal(pred.saturated.numpy(), again.saturated.numpy())


@pytest.mark.parametrize("headroom", [0.5, 0.0, -1.0, float("nan"), 448 * 2**6 + 1])
def test_headroom_outside_the_configurations_rule_is_refused(headroom):
    """The same rule as the configuration's (choices.check_headroom), not a looser one of its own."""
    with pytest.raises(ValueError, match="--headroom must be a number ≥ 1.0"):
        _observe(_collect(_data("gaussian")), "max", per_head=False, headroom=headroom)


@pytest.mark.parametrize("observer", ["max", "percentile:99.9", "mse", "sink-aware"])
def test_per_head_and_per_tensor_shapes(observer):
    stats = _collect(_data("gaussian"), _data("laplace", seed=1), _data("heavy_outliers", seed=2))  # 3 layers
    for per_head, shape in ((True, (3, H)), (False, (3,))):
        scale, pred = _observe(stats, observer, per_head)
        assert scale.shape == shape and scale.dtype == torch.float32
        for name in ("saturated", "underflow", "rel_mse"):
            assert getattr(pred, name).shape == shape
    if observer in ("max", "sink-aware"):  # a maximum over heads, so the tensor scale is the largest head scale
        per_head_scale = _observe(stats, observer, True)[0]
        np.testing.assert_array_equal(_observe(stats, observer, False)[0].numpy(), per_head_scale.amax(1).numpy())


# ---------------------------------------------------------------------------------------------------------------
# sink-aware


def _with_sinks(seed: int = 0) -> np.ndarray:
    x = _data("gaussian", seed)
    x[0, :, :SINK_POSITIONS] *= 1000  # attention-sink tokens far above everything else
    return x


@pytest.mark.parametrize("granularity", list(GRANULARITY))
def test_sink_aware_ignores_sinks_and_reports_their_saturation(granularity):
    per_head = GRANULARITY[granularity]
    x = _with_sinks()
    stats = _collect(x)
    scale, pred = _observe(stats, "sink-aware", per_head)
    later = x[:, :, SINK_POSITIONS:]
    sinks = x[:, :, :SINK_POSITIONS]
    want = [np.float32(np.abs(v.astype(np.float64)).max() / 448) for v in _pooled(later, per_head)]
    np.testing.assert_array_equal(scale.flatten().numpy(), want)
    sink_sat = sink_saturation(stats, scale, E4M3)
    assert sink_sat.shape == scale.shape
    for i, (v_sink, v_all) in enumerate(zip(_pooled(sinks, per_head), _pooled(x, per_head))):
        s = scale.flatten()[i].item()
        true_sink = _true_cost(v_sink, s)["saturated"]
        assert true_sink > 0.5  # sinks 1000× the rest: most of them clip
        assert abs(sink_sat.flatten()[i].item() - true_sink) <= _one_bin_bound(v_sink, 448 * s)
        true_all = _true_cost(v_all, s)["saturated"]  # the overall prediction counts them too
        assert abs(pred.saturated.flatten()[i].item() - true_all) <= _one_bin_bound(v_all, 448 * s)
    assert (_observe(stats, "max", per_head)[0] > scale * 100).all()  # max would have followed the sinks


def test_sink_aware_without_later_positions_falls_back_to_max():
    x = _with_sinks()[:, :, :SINK_POSITIONS]  # only positions 0..3 seen
    stats = _collect(x)
    np.testing.assert_array_equal(_observe(stats, "sink-aware", True)[0].numpy(), _observe(stats, "max", True)[0].numpy())


def test_sink_saturation_is_nil_when_nothing_clips():
    stats = _collect(_with_sinks())
    scale, _ = _observe(stats, "max", per_head=True)
    # float32(absmax / 448) × 448 may fall a float32 step below absmax: a sliver of the top bin "clips".
    assert (sink_saturation(stats, scale, E4M3) < 1e-6).all()


# ---------------------------------------------------------------------------------------------------------------
# per-token error


@pytest.mark.parametrize("kind", ["gaussian", "heavy_outliers", "tiny"])
def test_token_rel_mse_matches_brute_force(kind):
    x = _data(kind)
    stats = _collect(x)
    x64 = x.astype(np.float64)[0]  # [H, S, D]
    scale = np.maximum(np.abs(x64).max(-1, keepdims=True) / 448.0, 1e-6)  # vLLM's fp8_per_token_head
    sqerr = ((e4m3_quantize_dequantize(x[0], scale.astype(np.float32)) - x64) ** 2).sum((1, 2))  # [H]
    energy = (x64**2).sum((1, 2))
    np.testing.assert_allclose(token_rel_mse(stats, per_head=True)[0].numpy(), sqerr / energy, rtol=1e-4)
    np.testing.assert_allclose(token_rel_mse(stats, per_head=False)[0].item(), sqerr.sum() / energy.sum(), rtol=1e-4)


def test_token_rel_mse_of_zero_layer_is_zero():
    assert (token_rel_mse(_collect(_data("zero")), per_head=True) == 0).all()


# ---------------------------------------------------------------------------------------------------------------
# parsing and derive_scales


@pytest.mark.parametrize("text, spec", [
    ("max", ObserverSpec("max")),
    ("mse", ObserverSpec("mse")),
    ("sink-aware", ObserverSpec("sink-aware")),
    ("percentile:99.99", ObserverSpec("percentile", 99.99)),
    (" percentile:100 ", ObserverSpec("percentile", 100.0)),
])
def test_parse_observer(text, spec):
    assert parse_observer(text) == spec
    assert parse_observer(str(spec)) == spec  # str() round-trips


@pytest.mark.parametrize("text, message", [
    ("maximum", "choose one of: " + ", ".join(OBSERVERS)),
    ("max:3", "choose one of: "),
    ("", "choose one of: "),
    ("percentile", "write the percentile as a number, e.g. percentile:99.99"),
    ("percentile:high", "write the percentile as a number"),
    ("percentile:0", r"must be in \(0, 100\]"),
    ("percentile:100.5", r"must be in \(0, 100\]"),
    ("percentile:-5", r"must be in \(0, 100\]"),
])
def test_parse_observer_errors_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        parse_observer(text)


def test_parse_granularity():
    for g in GRANULARITIES:
        assert parse_granularity(g) == g
    with pytest.raises(ValueError, match="choose one of: tensor, head, token"):
        parse_granularity("channel")


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_derive_scales(fmt_name, granularity):
    fmt = FORMATS[fmt_name]
    k, v, q = _collect(_data("gaussian")), _collect(_data("laplace", 1)), _collect(_with_sinks(2))
    result = derive_scales({"k": k, "v": v, "q": q}, observer="max", granularity=granularity, fmt=fmt, headroom=1.5)
    assert set(result.scales) == set(result.predictions) == set(result.token_rel_mse) == {"k", "v", "q"}
    assert result.observer == "max" and result.granularity == granularity and result.per_head == (granularity == "head")
    for kind, stats in (("k", k), ("v", v), ("q", q)):
        want, _ = observe(stats, parse_observer("max"), fmt, per_head=granularity == "head", headroom=1.5)
        np.testing.assert_array_equal(result.scales[kind].numpy(), want.numpy())
        np.testing.assert_array_equal(result.token_rel_mse[kind].numpy(), token_rel_mse(stats, granularity == "head").numpy())
        # The sink tokens' saturation under the chosen scales is reported with them (docs/usage.md: Observers, sink-aware).
        np.testing.assert_array_equal(result.sink_saturated[kind].numpy(), sink_saturation(stats, want, fmt).numpy())
    without_q = derive_scales({"k": k, "v": v, "q": q}, observer="mse", granularity=granularity, fmt=fmt, query_scale=False)
    assert set(without_q.scales) == {"k", "v"}


def test_derive_scales_checks_its_arguments():
    stats = {"k": _collect(_data("gaussian")), "v": _collect(_data("gaussian"))}
    with pytest.raises(ValueError, match="choose one of"):
        derive_scales(stats, observer="minmax", granularity="tensor", fmt=E4M3, query_scale=False)
    with pytest.raises(ValueError, match="choose one of: tensor, head, token"):
        derive_scales(stats, observer="max", granularity="layer", fmt=E4M3, query_scale=False)


def test_e4m3fnuz_scales_are_in_its_own_units():
    """Same data, e4m3fnuz: max 240 instead of 448, so the absmax scale is 448/240 times larger."""
    stats = _collect(_data("gaussian"))
    fn, _ = _observe(stats, "max", True, FORMATS["e4m3fn"])
    fnuz, _ = _observe(stats, "max", True, FORMATS["e4m3fnuz"])
    np.testing.assert_allclose(fnuz.numpy(), fn.numpy() * 448 / 240, rtol=2**-23)
    assert math.isclose(FORMATS["e4m3fnuz"].max, 240)


def test_an_observer_without_a_rule_fails_at_import():
    """A name added to choices.OBSERVERS with no entry in OBSERVER_SCALES stops the import (it once fell through to
    MSE scales); run in a fresh interpreter so this process's modules stay as they are."""
    code = ("import calibrate.choices as c\n"
            "c.OBSERVERS = (*c.OBSERVERS, 'median')\n"
            "import calibrate.scales.observers\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "observers.OBSERVER_SCALES covers" in proc.stderr and "'median'" in proc.stderr


def test_the_output_observer_is_refused_from_statistics_alone():
    x = np.random.default_rng(0).standard_normal((1, 2, 64, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="runs the model"):
        _observe(_collect(x), "output", per_head=False)
