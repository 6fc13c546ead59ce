"""Statistics → FP8 scales, with no model run.

An observer reads the |x| histogram (or absmax) of one tensor and picks the dequantization scale
(``x ≈ fp8 × scale``). Every choice also gets a prediction, from the same histogram, of what it
costs: the fraction of values that saturate, the fraction that fall to subnormal or zero, and the
expected squared quantization error relative to the signal.
"""

from dataclasses import dataclass

import torch

from .fp8 import SCALE_FLOOR, FP8Format
from .stats import NUM_BINS, SINK_POSITIONS, TensorStats, bin_edges

OBSERVERS = ("max", "percentile:P", "mse", "sink-aware")
GRANULARITIES = ("tensor", "head", "token")
# Samples per histogram bin when integrating the quantization error (stratified, uniform in the bin).
_SAMPLES_PER_BIN = 4
# MSE search: candidate scales from absmax/fmt.max down by up to 2**-8, in steps of 2**(1/16).
_MSE_STEPS = 128
_MSE_STEP = 2.0 ** (-1 / 16)


@dataclass(frozen=True)
class ObserverSpec:
    """A parsed ``--observer`` value."""

    name: str  # "max", "percentile", "mse" or "sink-aware"
    percentile: float | None = None

    def __str__(self) -> str:
        return f"percentile:{self.percentile:g}" if self.name == "percentile" else self.name


def parse_observer(text: str) -> ObserverSpec:
    """Parse ``max``, ``percentile:99.99``, ``mse`` or ``sink-aware``; ValueError lists the choices."""
    name, _, arg = text.strip().partition(":")
    if name == "percentile":
        try:
            p = float(arg)
        except ValueError:
            raise ValueError(f"observer {text!r}: write the percentile as a number, e.g. percentile:99.99") from None
        if not 0 < p <= 100:
            raise ValueError(f"observer {text!r}: the percentile must be in (0, 100], e.g. percentile:99.99")
        return ObserverSpec("percentile", p)
    if name in ("max", "mse", "sink-aware") and not arg:
        return ObserverSpec(name)
    raise ValueError(f"unknown observer {text!r}; choose one of: {', '.join(OBSERVERS)}")


def parse_granularity(text: str) -> str:
    if text not in GRANULARITIES:
        raise ValueError(f"unknown granularity {text!r}; choose one of: {', '.join(GRANULARITIES)}")
    return text


@dataclass
class Prediction:
    """What a scale is predicted to do to the values it was fitted on (fractions of all elements)."""

    saturated: torch.Tensor  # |x| > fmt.max × scale
    underflow: torch.Tensor  # 0 < |x| < fmt.min_normal × scale: stored as subnormal or zero
    rel_mse: torch.Tensor  # E[(x − q(x))²] / E[x²]


def _bin_samples(absmax: torch.Tensor) -> torch.Tensor:
    """Representative |x| values of every bin: [..., NUM_BINS, _SAMPLES_PER_BIN] float64, clipped to absmax."""
    edges = bin_edges()  # [NUM_BINS, 2]
    lo, hi = edges[:, 0], edges[:, 1].clamp(max=2.0**30)
    t = (torch.arange(_SAMPLES_PER_BIN, dtype=torch.float64) + 0.5) / _SAMPLES_PER_BIN  # [S]
    samples = lo[:, None] + (hi - lo)[:, None] * t  # [NUM_BINS, S]
    return torch.minimum(samples, absmax.double()[..., None, None])  # [..., NUM_BINS, S]


def _sq_error(samples: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Squared quantize-dequantize error of ``samples`` [..., NB, S] at ``scale`` [...], mean over S → [..., NB]."""
    s = scale.double()[..., None, None]
    q = (samples / s).clamp(-fmt.max, fmt.max).float().to(fmt.dtype).double() * s
    return (samples - q).square().mean(-1)


@torch.no_grad()
def predict(hist: torch.Tensor, absmax: torch.Tensor, sumsq: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> Prediction:
    """Predicted saturation, underflow and relative MSE of ``scale`` for data with histogram ``hist``.

    Shapes: hist [..., NUM_BINS]; absmax, sumsq and scale [...]. Partial bins are split assuming
    values are uniform inside a bin, so the fractions are exact up to one bin's width.
    """
    counts = hist.double()
    n = counts.sum(-1).clamp(min=1)
    edges = bin_edges()
    top = absmax.double()[..., None]  # no value lies above absmax: clip the bins to it
    lo, hi = torch.minimum(edges[:, 0], top), torch.minimum(edges[:, 1], top)  # [..., NB]
    width = (hi - lo).clamp(min=1e-300)

    def fraction_above(t: torch.Tensor) -> torch.Tensor:  # t [...] → fraction of elements with |x| > t
        share = ((hi - t[..., None]) / width).clamp(0, 1)  # [..., NB]
        return (counts * share).sum(-1) / n

    def fraction_between_zero_and(t: torch.Tensor) -> torch.Tensor:
        share = ((t[..., None] - lo) / width).clamp(0, 1)
        share[..., 0] = 0  # exact zeros are not underflow
        return (counts * share).sum(-1) / n

    s = scale.double()
    sq = (counts * _sq_error(_bin_samples(absmax), s, fmt)).sum(-1)
    return Prediction(
        saturated=fraction_above(fmt.max * s).float(),
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
    """The scale, among absmax/fmt.max × 2**(−j/16), j < _MSE_STEPS, with least expected squared error."""
    base = (absmax.double() / fmt.max).clamp(min=SCALE_FLOOR)  # [...]
    factors = _MSE_STEP ** torch.arange(_MSE_STEPS, dtype=torch.float64)  # [C]
    counts = hist.double()
    used = counts.flatten(0, -2).sum(0) > 0  # bins non-empty anywhere: [NB]
    samples = _bin_samples(absmax)[..., used, :]  # [..., nb, S]
    best_err = torch.full_like(base, float("inf"))
    best = base.clone()
    for f in factors:
        cand = base * f
        err = (counts[..., used] * _sq_error(samples, cand, fmt)).sum(-1)  # [...]
        better = err < best_err
        best = torch.where(better, cand, best)
        best_err = torch.where(better, err, best_err)
    return best


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
    if not headroom > 0:
        raise ValueError(f"--headroom must be positive (1.0 = none), got {headroom}")
    hist, absmax, sumsq = stats.hist, stats.absmax, stats.sumsq  # [L, H, NB], [L, H], [L, H]
    non_sink_absmax = stats.pos_absmax[..., SINK_POSITIONS:].amax(-1)  # [L, H]
    if not per_head:
        hist, sumsq = hist.sum(1), sumsq.sum(1)  # [L, NB], [L]
        absmax, non_sink_absmax = absmax.amax(1), non_sink_absmax.amax(1)  # [L]

    if spec.name == "max":
        value = absmax.double()
    elif spec.name == "percentile":
        value = _percentile_value(hist, absmax, spec.percentile)
    elif spec.name == "sink-aware":
        # Positions past the first SINK_POSITIONS set the scale; the sink tokens may saturate (reported).
        no_later_tokens = non_sink_absmax == 0
        value = torch.where(no_later_tokens, absmax, non_sink_absmax).double()
    else:
        value = None
    if value is not None:
        scale = (value / fmt.max).clamp(min=SCALE_FLOOR)
    else:
        scale = _mse_scale(hist, absmax, fmt)
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

    ``scales`` are what the FP8 cache uses (``fmt``'s own units); ``checkpoint_scales()`` are what
    to write so that vLLM, after its own adjustment for the format, uses exactly those.
    """

    observer: str
    granularity: str
    fmt: FP8Format
    headroom: float
    scales: dict[str, torch.Tensor]  # kind → [L] or [L, H]
    predictions: dict[str, Prediction]
    token_rel_mse: dict[str, torch.Tensor]  # kind → [L] or [L, H], exact, for the per-token-head mode

    @property
    def per_head(self) -> bool:
        return self.granularity == "head"

    def checkpoint_scales(self) -> dict[str, torch.Tensor]:
        return {kind: s / self.fmt.loaded_scale_multiplier for kind, s in self.scales.items()}


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
    per_head = parse_granularity(granularity) == "head"
    kinds = ("k", "v", "q") if query_scale else ("k", "v")
    scales, predictions, token_err = {}, {}, {}
    for kind in kinds:
        scales[kind], predictions[kind] = observe(stats[kind], spec, fmt, per_head=per_head, headroom=headroom)
        token_err[kind] = token_rel_mse(stats[kind], per_head)
    return ScaleSet(str(spec), granularity, fmt, headroom, scales, predictions, token_err)
