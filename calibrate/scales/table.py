"""The per-layer table of absmax, scale and predicted saturation that ``kvcal calibrate`` prints (``result.py``)."""

import torch

from ..capture.stats import KINDS


def scale_table(
    layers: list[int], absmax: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], saturated: dict[str, torch.Tensor]
) -> str:
    """Per-layer table of absmax, scale and predicted saturation for k, v and q (max over heads when per head)."""
    kinds = [k for k in KINDS if k in scales]
    header = f"{'layer':>5} " + " ".join(f"{k + ' absmax':>10} {k + '_scale':>10} {k + ' sat%':>7}" for k in kinds)
    rows = [header, "-" * len(header)]
    for row, layer in enumerate(layers):
        cells = []
        for k in kinds:
            scale = scales[k][row].max().item()
            cells.append(f"{absmax[k][row].max().item():>10.4g} {scale:>10.4g} {100 * saturated[k][row].max().item():>7.3f}")
        rows.append(f"{layer:>5} " + " ".join(cells))
    return "\n".join(rows)
