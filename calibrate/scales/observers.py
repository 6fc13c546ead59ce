"""Statistics → FP8 scales, with no model run.

An observer reads the |x| histogram (or absmax) of one tensor and picks the dequantization scale
(``x ≈ fp8 × scale``). Every choice also gets a prediction, from the same histogram, of what it
costs: the fraction of values that saturate, the fraction that fall to subnormal or zero, and the
expected squared quantization error relative to the signal.
"""

from dataclasses import dataclass

import torch

from ..capture.stats import NUM_BINS, SINK_POSITIONS, TensorStats, bin_edges
from ..choices import (
    OBSERVERS,
    OUTPUT_OBSERVER,
    check_granularity,
    check_headroom,
    check_observer,
    check_table,
    runs_the_model,
)
from ..fp8 import SATURATION_SLACK, SCALE_FLOOR, FP8Format, amax_to_scale

# Samples per histogram bin when integrating the quantization error (stratified, uniform in the bin).
_SAMPLES_PER_BIN = 4
# MSE search: candidate scales absmax/fmt.max × 2**(−j/16) for j < _MSE_STEPS (down to 2**-8 of the
# max scale), searched coarse to fine: every _MSE_COARSE-th j, then every j within _MSE_COARSE of the best.
_MSE_STEPS = 128
_MSE_COARSE = 8
# Candidate × sample pairs evaluated at once in the MSE search: bounds its memory (~25 bytes of temporaries each).
_MSE_BATCH = 1 << 20


@dataclass(frozen=True)
class ObserverSpec:
    """A parsed ``--observer`` value."""

    name: str  # "max", "percentile", "mse" or "sink-aware"
    percentile: float | None = None

    def __str__(self) -> str:
        return f"percentile:{self.percentile:g}" if self.name == "percentile" else self.name


def parse_observer(text: str) -> ObserverSpec:
    """Parse ``max``, ``percentile:99.99``, ``mse`` or ``sink-aware``; ValueError lists the choices."""
    check_observer(text)
    name, _, arg = text.strip().partition(":")
    return ObserverSpec("percentile", float(arg)) if name == "percentile" else ObserverSpec(name)


def parse_granularity(text: str) -> str:
    check_granularity(text)
    return text


@dataclass
class Prediction:
    """What a scale is predicted to do to the values it was fitted on (fractions of all elements)."""

    saturated: torch.Tensor  # |x| > fmt.max × scale (beyond the float32 rounding of the scale: SATURATION_SLACK)
    underflow: torch.Tensor  # 0 < |x| < fmt.min_normal × scale: stored as subnormal or zero
    rel_mse: torch.Tensor  # E[(x − q(x))²] / E[x²]


def _bin_samples(bins: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Representative |x| values of the histogram bins ``bins`` (int64), uniform inside each bin.

    ``top`` (float64, broadcasting against ``bins``) clips them: no value lies above absmax.
    Returns [..., _SAMPLES_PER_BIN] float64.
    """
    edges = bin_edges()[bins]  # [..., 2]
    lo, hi = edges[..., 0], edges[..., 1].clamp(max=2.0**30)
    t = (torch.arange(_SAMPLES_PER_BIN, dtype=torch.float64) + 0.5) / _SAMPLES_PER_BIN  # [S]
    samples = lo[..., None] + (hi - lo)[..., None] * t  # [..., S]
    return torch.minimum(samples, top[..., None])


def _sq_error(samples: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Squared quantize-dequantize error of ``samples`` [..., S] at ``scale``, mean over S → [...] float64.

    ``scale`` (float64) broadcasts against ``samples.shape[:-1]``. Like vLLM's cache write,
    ``fp8(x / scale)`` is computed in float32.
    """
    y = samples.float() / scale.float()[..., None]  # [..., S], in units of the scale
    decoded = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()  # the value of every FP8 code
    codes = y.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8).long()  # [..., S]
    y.sub_(decoded.take(codes)).square_()  # a table look-up: faster than converting FP8 to float
    return y.mean(-1).double() * scale.double().square()


@torch.no_grad()
def predict(hist: torch.Tensor, absmax: torch.Tensor, sumsq: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> Prediction:
    """Predicted saturation, underflow and relative MSE of ``scale`` for data with histogram ``hist``.

    Shapes: hist [..., NUM_BINS]; absmax, sumsq and scale [...]. Partial bins are split assuming
    values are uniform inside a bin, so the fractions are exact up to one bin's width.
    """
    bins = (hist.reshape(-1, NUM_BINS).sum(0) > 0).nonzero().flatten()  # bins non-empty anywhere: [nb]
    counts = hist[..., bins].double()  # [..., nb]; the empty bins add nothing
    n = counts.sum(-1).clamp(min=1)
    edges = bin_edges()[bins]  # [nb, 2]
    top = absmax.double()[..., None]  # no value lies above absmax: clip the bins to it
    lo, hi = torch.minimum(edges[:, 0], top), torch.minimum(edges[:, 1], top)  # [..., nb]
    width = (hi - lo).clamp(min=1e-300)

    def fraction_above(t: torch.Tensor) -> torch.Tensor:  # t [...] → fraction of elements with |x| > t
        share = ((hi - t[..., None]) / width).clamp(0, 1)  # [..., nb]
        return (counts * share).sum(-1) / n

    def fraction_between_zero_and(t: torch.Tensor) -> torch.Tensor:
        share = ((t[..., None] - lo) / width).clamp(0, 1) * (bins > 0)  # exact zeros (bin 0) are not underflow
        return (counts * share).sum(-1) / n

    s = scale.double()
    sq = (counts * _sq_error(_bin_samples(bins, top), s[..., None], fmt)).sum(-1)
    return Prediction(
        saturated=fraction_above(fmt.max * (1 + SATURATION_SLACK) * s).float(),
        underflow=fraction_between_zero_and(fmt.min_normal * s).float(),
        rel_mse=(sq / sumsq.double().clamp(min=1e-300)).float(),
    )


def _percentile_value(hist: torch.Tensor, absmax: torch.Tensor, p: float) -> torch.Tensor:
    """Upper edge of the bin holding the p-th percentile of |x| (never above absmax): [...]."""
    cum = hist.cumsum(-1).double()  # [..., NB]
    target = cum[..., -1:] * (p / 100.0)
    idx = torch.searchsorted(cum, target).squeeze(-1).clamp(max=NUM_BINS - 1)  # first bin reaching the target
    upper = bin_edges()[:, 1][idx]
    return torch.minimum(upper, absmax.double())


def _mse_scale(hist: torch.Tensor, absmax: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """The scale, among absmax/fmt.max × 2**(−j/16), j < _MSE_STEPS, with least expected squared error.

    The error is ``predict``'s (bin samples weighted by counts), over the non-empty bins only. The
    search is coarse to fine: every _MSE_COARSE-th j, then each j within _MSE_COARSE of the best
    (the error is smooth in the scale apart from ripples smaller than a coarse step). Ties go to the
    larger scale. Never below SCALE_FLOOR. Shapes: hist [..., NUM_BINS], absmax [...] → [...].
    """
    base = amax_to_scale(absmax, fmt, dtype=torch.float64)  # [...]
    counts = hist.reshape(-1, NUM_BINS)  # [R, NB], one row per scale
    rows, bins = counts.nonzero(as_tuple=True)  # the non-empty bins: [N] each
    weight = counts[rows, bins].double()  # [N]
    samples = _bin_samples(bins, absmax.double().flatten()[rows])  # [N, S]
    row_base = base.flatten()[rows]  # [N]
    every_row = torch.arange(counts.shape[0])  # [R]

    def best_of(steps: torch.Tensor) -> torch.Tensor:
        """steps [C, R] candidate j per row → the j with least error per row [R] (first of equals)."""
        err = torch.zeros(steps.shape, dtype=torch.float64)  # [C, R]
        batch = max(1, _MSE_BATCH // max(1, samples.numel()))
        for c in range(0, steps.shape[0], batch):
            cand = (row_base * torch.exp2(-steps[c : c + batch, rows] / 16)).clamp(min=SCALE_FLOOR)  # [c, N]
            err[c : c + batch].index_add_(1, rows, weight * _sq_error(samples, cand, fmt))  # [c, R]
        return steps[err.argmin(0), every_row]

    coarse = torch.arange(0, _MSE_STEPS, _MSE_COARSE, dtype=torch.float64)[:, None].expand(-1, len(every_row))  # [C, R]
    best = best_of(coarse)  # [R]
    around = torch.arange(-_MSE_COARSE + 1, _MSE_COARSE, dtype=torch.float64)[:, None]  # [2*_MSE_COARSE - 1, 1]
    best = best_of((best + around).clamp(0, _MSE_STEPS - 1))  # [R]
    return (base * torch.exp2(-best / 16).view(base.shape)).clamp(min=SCALE_FLOOR)


def _max(spec: ObserverSpec, hist: torch.Tensor, absmax: torch.Tensor, non_sink: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """The largest value seen maps to the format's max."""
    return amax_to_scale(absmax.double(), fmt, dtype=torch.float64)


def _percentile(spec: ObserverSpec, hist: torch.Tensor, absmax: torch.Tensor, non_sink: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """The P-th percentile of |x| maps to the format's max; the values above it saturate (predicted)."""
    return amax_to_scale(_percentile_value(hist, absmax, spec.percentile), fmt, dtype=torch.float64)


def _sink_aware(spec: ObserverSpec, hist: torch.Tensor, absmax: torch.Tensor, non_sink: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Positions past the first SINK_POSITIONS set the scale; the sink tokens may saturate (reported). A tensor seen
    only at sink positions falls back to its absmax."""
    return amax_to_scale(torch.where(non_sink == 0, absmax, non_sink).double(), fmt, dtype=torch.float64)


def _mse(spec: ObserverSpec, hist: torch.Tensor, absmax: torch.Tensor, non_sink: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    return _mse_scale(hist, absmax, fmt)


def _runs_the_model(spec: ObserverSpec, *_) -> torch.Tensor:
    raise ValueError(f"the {spec.name} observer runs the model (scales/search.py); statistics alone cannot give its scales")


# The observers by the names choices.OBSERVERS gives them (percentile:P as "percentile"): each maps one tensor's
# statistics (hist [..., NB], absmax [...], absmax past the sink positions [...]) to float64 dequantization scales [...].
OBSERVER_SCALES = {"max": _max, "percentile": _percentile, "mse": _mse, "sink-aware": _sink_aware,
                   OUTPUT_OBSERVER: _runs_the_model}
check_table(OBSERVER_SCALES, tuple(name.partition(":")[0] for name in OBSERVERS), "observers.OBSERVER_SCALES")


@torch.no_grad()
def observe(
    stats: TensorStats, spec: ObserverSpec, fmt: FP8Format, *, per_head: bool, headroom: float = 1.0
) -> tuple[torch.Tensor, Prediction]:
    """Scales for one tensor kind and their predicted cost.

    Args:
        stats: the statistics of k, v or q.
        spec: which observer.
        fmt: the FP8 format the cache will use (scales are in that format's own units).
        per_head: one scale per (layer, head) → [L, H]; otherwise one per layer → [L].
        headroom: multiplier ≥ 1 applied to the observer's choice, leaving range for unseen data.

    Returns:
        (scales float32, strictly positive and finite; Prediction for those scales).
    """
    check_headroom(headroom)
    hist, absmax, sumsq = stats.hist, stats.absmax, stats.sumsq  # [L, H, NB], [L, H], [L, H]
    non_sink_absmax = stats.pos_absmax[..., SINK_POSITIONS:].amax(-1)  # [L, H]
    if not per_head:
        hist, sumsq = hist.sum(1), sumsq.sum(1)  # [L, NB], [L]
        absmax, non_sink_absmax = absmax.amax(1), non_sink_absmax.amax(1)  # [L]

    scale = OBSERVER_SCALES[spec.name](spec, hist, absmax, non_sink_absmax, fmt)
    scale = (scale * headroom).float()
    return scale, predict(hist, absmax, sumsq, scale, fmt)


@torch.no_grad()
def sink_saturation(stats: TensorStats, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Fraction of the sink tokens' values (first SINK_POSITIONS positions) that ``scale`` saturates."""
    sink_hist = stats.sink_hist if scale.dim() == 2 else stats.sink_hist.sum(1)
    absmax = stats.absmax if scale.dim() == 2 else stats.absmax.amax(1)
    zero = torch.zeros_like(absmax)
    return predict(sink_hist, absmax, zero, scale, fmt).saturated


def token_rel_mse(stats: TensorStats, per_head: bool) -> torch.Tensor:
    """Exact relative squared error of vLLM's per-token-head FP8 scaling, measured during capture."""
    if per_head:
        return (stats.token_sqerr / stats.sumsq.clamp(min=1e-300)).float()
    return (stats.token_sqerr.sum(1) / stats.sumsq.sum(1).clamp(min=1e-300)).float()


@dataclass
class ScaleSet:
    """The scales of one observer and granularity, with their predicted cost, per tensor kind.

    ``scales`` are what the FP8 cache uses (``fmt``'s own units); ``checkpoint.write.stored_scales`` gives what a
    compressed-tensors checkpoint stores so that vLLM, after its loader's adjustment, uses exactly those.
    """

    observer: str
    granularity: str
    fmt: FP8Format
    headroom: float
    scales: dict[str, torch.Tensor]  # kind → [L] or [L, H]
    predictions: dict[str, Prediction]
    token_rel_mse: dict[str, torch.Tensor]  # kind → [L] or [L, H], exact, for the per-token-head mode
    sink_saturated: dict[str, torch.Tensor]  # kind → [L] or [L, H]: fraction of the sink tokens' values saturated

    @property
    def per_head(self) -> bool:
        return self.granularity == "head"



def derive_scales(
    stats: dict[str, TensorStats],
    *,
    observer: str,
    granularity: str,
    fmt: FP8Format,
    headroom: float = 1.0,
    query_scale: bool = True,
) -> ScaleSet:
    """Scales for k, v (and q) of every layer from the statistics.

    ``token`` granularity writes per-tensor scales (the fallback vLLM uses outside its per-token
    mode) and reports the exact per-token error measured during capture beside them.
    """
    spec = parse_observer(observer)
    if runs_the_model(spec.name):
        raise ValueError("the output observer runs the model on held-back data (kvcal calibrate --observer output); "
                         "from saved statistics alone choose max, mse, percentile:P or sink-aware")
    per_head = parse_granularity(granularity) == "head"
    kinds = ("k", "v", "q") if query_scale else ("k", "v")
    scales, predictions, token_err, sinks = {}, {}, {}, {}
    for kind in kinds:
        scales[kind], predictions[kind] = observe(stats[kind], spec, fmt, per_head=per_head, headroom=headroom)
        token_err[kind] = token_rel_mse(stats[kind], per_head)
        sinks[kind] = sink_saturation(stats[kind], scales[kind], fmt)
    return ScaleSet(str(spec), granularity, fmt, headroom, scales, predictions, token_err, sinks)


def recorded_scales(
    stats: dict[str, TensorStats], scales: dict[str, torch.Tensor], *, observer: str, granularity: str, fmt: FP8Format,
    headroom: float,
) -> ScaleSet:
    """The ScaleSet of scales chosen before (a calibration's own, as its provenance records them), with their predicted
    cost on ``stats``: for an observer that cannot be re-derived from statistics alone (output).

    Args:
        scales: kind → [L] or [L, H] dequantization scales in ``fmt``'s own units (``ScaleSet.scales``).
    """
    per_head = parse_granularity(granularity) == "head"
    predictions, token_err, sinks = {}, {}, {}
    for kind, scale in scales.items():
        s = stats[kind]
        hist, absmax, sumsq = (s.hist, s.absmax, s.sumsq) if per_head else (s.hist.sum(1), s.absmax.amax(1), s.sumsq.sum(1))
        predictions[kind] = predict(hist, absmax, sumsq, scale, fmt)
        token_err[kind] = token_rel_mse(s, per_head)
        sinks[kind] = sink_saturation(s, scale, fmt)
    return ScaleSet(observer, granularity, fmt, headroom, scales, predictions, token_err, sinks)


@torch.no_grad()
def latent_report(stats: dict[str, TensorStats], latent_dim: int, fmt: FP8Format) -> dict:
    """What an MLA layer's one k scale covers, per layer, as plain lists for JSON.

    The latent (the first ``latent_dim`` channels of k) and k_pe (the rest) are reported apart, with the fraction of
    k and q values that saturate at scale 1.0: what vLLM (vllm_facts.release.READ_IN) uses for MLA layers whatever the checkpoint holds.
    """
    channels = stats["k"].channel_absmax[:, 0]  # [L, latent_dim + rope_dim]
    ones = torch.ones(channels.shape[0])
    at_one = {kind: predict(stats[kind].hist.sum(1), stats[kind].absmax.amax(1), stats[kind].sumsq.sum(1), ones, fmt)
              for kind in ("k", "q")}
    return {
        "latent_absmax": channels[:, :latent_dim].amax(1).tolist(),
        "k_pe_absmax": channels[:, latent_dim:].amax(1).tolist() if channels.shape[1] > latent_dim else [0.0] * len(ones),
        "saturated_at_scale_1": {kind: p.saturated.tolist() for kind, p in at_one.items()},
    }

