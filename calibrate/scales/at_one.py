"""What vLLM's scale of 1.0 (a checkpoint without KV scales) would do to the K, V and Q a calibration saw.

At scale 1.0 a value is stored as itself, so whatever lies beyond the FP8 format's largest value is clipped to it. From
the statistics alone, per layer and kind: the largest |x| (exact, ``absmax``) and the fraction of values at or above
the format's largest value, counted from the |x| histogram. That count is exact, not a bound: every FP8 format's
largest value (448, 240, 57344) is an edge of the histogram's bins (``capture/stats.py``), so no bin straddles it. A
value exactly at the largest value is stored without error; the fraction counts it all the same ("at or above").
"""

from dataclasses import dataclass

import torch

from ..capture.stats import KINDS, Stats, bin_edges
from ..fp8 import FP8Format


@dataclass(frozen=True)
class AtOne:
    """One tensor kind at scale 1.0, per observed layer (rows in the statistics' order)."""

    kind: str
    absmax: list[float]  # [L] largest |x| over heads
    beyond: list[float]  # [L] fraction of values with |x| ≥ the format's largest value, over heads

    def clipped(self, fmt: FP8Format) -> list[int]:
        """Rows whose largest value lies beyond the format's range: the layers scale 1.0 would clip."""
        return [row for row, amax in enumerate(self.absmax) if amax > fmt.max]


@torch.no_grad()
def at_scale_one(stats: Stats, fmt: FP8Format) -> dict[str, AtOne]:
    """Kind → what scale 1.0 does to it, from ``stats``' histograms and absmax (exact; module docstring)."""
    lower = bin_edges()[:, 0].contiguous()  # [NUM_BINS] lower edge of each bin, non-decreasing
    first = int(torch.searchsorted(lower, fmt.max))  # first bin whose values are all ≥ fmt.max
    if first >= len(lower) or lower[first] != fmt.max:
        raise RuntimeError(f"{fmt.max} is not a histogram bin edge: the count beyond it would not be exact")
    found = {}
    for kind in KINDS:
        s = stats.kinds[kind]
        hist = s.hist.sum(1)  # [L, NUM_BINS] over heads
        beyond = hist[:, first:].sum(-1).double() / hist.sum(-1).clamp(min=1).double()  # [L]
        found[kind] = AtOne(kind, s.absmax.amax(1).tolist(), beyond.tolist())
    return found


def at_one_line(found: dict[str, AtOne], fmt: FP8Format) -> str:
    """The one line calibrate, the model card and inspect give: which kinds scale 1.0 would clip, in how many layers
    and how far, or that nothing reaches the format's largest value."""
    clipping = {kind: at.clipped(fmt) for kind, at in found.items() if at.clipped(fmt)}
    if not clipping:
        largest = max(max(at.absmax, default=0.0) for at in found.values())
        return (f"no K, V or Q value reaches FP8 {fmt.name}'s largest value {fmt.max:g} at scale 1.0 (largest absmax "
                f"{largest:,.4g}): verify tells whether the calibrated scales still help")
    parts = []
    for kind, rows in clipping.items():
        at = found[kind]
        worst = max(at.beyond[row] for row in rows)
        parts.append(f"{kind.upper()} in {len(rows)} of {len(at.absmax)} layers (absmax up to "
                     f"{max(at.absmax[row] for row in rows):,.4g} > {fmt.max:g}; worst layer {100 * worst:.3g}% of "
                     "values at or above it)")
    return f"scale 1.0 would clip {', '.join(parts)}: serve the calibrated scales"


def at_one_report(found: dict[str, AtOne], fmt: FP8Format, layers: list[int]) -> dict:
    """For calibration.json: the format's largest value, per kind the layers' absmax and fraction at or above it, the
    layers (model indices) scale 1.0 would clip, and the line."""
    return {
        "fp8_max": fmt.max,
        "line": at_one_line(found, fmt),
        **{kind: {"absmax": at.absmax, "fraction_at_or_above_max": at.beyond,
                  "clipped_layers": [layers[row] for row in at.clipped(fmt)]} for kind, at in found.items()},
    }
