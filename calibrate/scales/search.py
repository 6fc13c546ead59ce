"""The ``output`` observer: each layer's K and V scales picked for the attention output they give.

The other observers fit a scale to K's or V's own values; what the model feels is the attention output. This
one takes its candidates from the saved histograms (the scales of the ``CANDIDATES`` observers), runs held-back
sequences (not in the statistics) through the model, and at every layer compares the attention output with K,
then V, quantized by each candidate against the unquantized output on the same inputs: the candidate with the
least squared error wins, layer by layer. K is searched with V unquantized and V with K unquantized (for small
errors the two add up); Q keeps the ``max`` scale. Cost: one forward of the held-back sequences, plus
2 × len(CANDIDATES) extra attention calls per layer.
"""

from dataclasses import fields

import torch

from ..capture.hooks import prefill_chunks
from ..capture.stats import Stats
from ..choices import OUTPUT_CANDIDATES as CANDIDATES
from ..choices import OUTPUT_OBSERVER, check_output_granularity
from ..fp8 import FP8Format, quantize_dequantize
from ..model.layers import AttentionLayer
from .observers import Prediction, ScaleSet, derive_scales

SEARCHED = ("k", "v")


class _Search:
    """Attention hook: the model's own attention, plus each candidate's for K and for V, with their squared errors."""

    def __init__(self, sets: list[ScaleSet], row_of: dict[int, int], fmt: FP8Format):
        self.row_of, self.fmt = row_of, fmt
        self.scales = {kind: torch.stack([s.scales[kind] for s in sets], 1) for kind in SEARCHED}  # [L, C] or [L, C, H]
        self.err = {kind: torch.zeros(self.scales[kind].shape[:2], dtype=torch.float64) for kind in SEARCHED}  # [L, C]

    def __call__(self, module, query, key, value, attention_mask, base_attention, **kwargs):
        out = base_attention(module, query, key, value, attention_mask, **kwargs)
        ref = out[0].float()  # [B, S, Hq, D]
        row = self.row_of[module.layer_idx]
        for kind, x in (("k", key), ("v", value)):
            for c, scale in enumerate(self.scales[kind][row]):
                xq = quantize_dequantize(x, scale.to(x.device).view(1, -1, 1, 1), self.fmt)  # [B, H, N, D]
                k, v = (xq, value) if kind == "k" else (key, xq)
                o = base_attention(module, query, k, v, attention_mask, **kwargs)[0]
                self.err[kind][row, c] += (o.float() - ref).square().sum(dtype=torch.float64).cpu()
        return out


@torch.no_grad()
def output_observer(
    model, layers: list[AttentionLayer], stats: Stats, sequences: list[torch.Tensor], chunk_len: int, *,
    granularity: str, fmt: FP8Format, headroom: float = 1.0, query_scale: bool = True,
) -> tuple[ScaleSet, dict]:
    """Scales whose attention output on ``sequences`` (held back from ``stats``) is closest to the unquantized one.

    Returns:
        (the scales, as any observer's, with the chosen candidates' predictions; the search: per kind, the
        candidate chosen per layer and every candidate's relative RMS error of the attention output).
    """
    check_output_granularity(granularity)
    if not sequences:
        raise ValueError("the output observer needs held-back sequences to search on, and every record of the data went "
                         "into the statistics (a record the budget cut counts whole): add records beyond --max-tokens "
                         "(in a .txt, a blank line separates records)")
    sets = [derive_scales(stats.kinds, observer=name, granularity=granularity, fmt=fmt, headroom=headroom,
                          query_scale=query_scale) for name in CANDIDATES]
    search = _Search(sets, {layer.layer_idx: row for row, layer in enumerate(layers)}, fmt)
    ref_sq = torch.zeros(len(layers), dtype=torch.float64)  # Σ‖o_ref‖² per layer, for relative errors

    def reference(module, query, key, value, attention_mask, base_attention, **kwargs):
        out = search(module, query, key, value, attention_mask, base_attention, **kwargs)
        ref_sq[search.row_of[module.layer_idx]] += out[0].float().square().sum(dtype=torch.float64).cpu()
        return out

    device = next(model.parameters()).device
    for seq in sequences:
        for _ in prefill_chunks(model, seq.to(device)[None], chunk_len, hook=reference):
            pass
    chosen = {kind: search.err[kind].argmin(1) for kind in SEARCHED}  # [L] candidate index per layer
    best = sets[0]  # max: Q's scale, and the fields no candidate changes
    picked = {kind: [sets[c] for c in chosen[kind].tolist()] for kind in SEARCHED}

    def by_row(kind: str, of) -> torch.Tensor:
        return torch.stack([of(s)[row] for row, s in enumerate(picked[kind])])  # [L] or [L, H]

    scales = {**best.scales, **{kind: by_row(kind, lambda s, k=kind: s.scales[k]) for kind in SEARCHED}}
    predictions = {**best.predictions, **{kind: Prediction(**{f.name: by_row(kind, lambda s, k=kind, n=f.name: getattr(s.predictions[k], n))
                                                             for f in fields(Prediction)}) for kind in SEARCHED}}
    sinks = {**best.sink_saturated, **{kind: by_row(kind, lambda s, k=kind: s.sink_saturated[k]) for kind in SEARCHED}}
    result = ScaleSet(OUTPUT_OBSERVER, granularity, fmt, headroom, scales, predictions, best.token_rel_mse, sinks)
    report = {kind: {"chosen": [CANDIDATES[c] for c in chosen[kind].tolist()],
                     "rel_error": (search.err[kind] / ref_sq[:, None].clamp(min=1e-300)).sqrt().tolist()}  # [L][C]
              for kind in SEARCHED}
    return result, {"candidates": list(CANDIDATES), "sequences": len(sequences), **report}
