"""Tests for calibrate/scales/table.py: the per-layer scale table ``kvcal calibrate`` prints.

Printed tables are parsed back into numbers and checked against the test's own float64 arithmetic (worst head = max
of a list, scale = absmax / 448), not compared with text copied from a run.
"""

import pytest
import torch

from calibrate.scales.table import scale_table

E4M3_MAX = 448.0


def parse_table(text: str) -> tuple[str, list[list[float]]]:
    """Header line, and each row after the rule as numbers."""
    header, rule, *rows = text.splitlines()
    assert set(rule) == {"-"} and len(rule) == len(header)
    return header, [[float(cell) for cell in row.split()] for row in rows]


ABSMAX = {  # [L, H] per head
    "k": [[0.5, 2.0], [3.0, 1.0], [0.0, 0.25]],
    "v": [[7.5, 0.125], [1e-3, 2e-3], [100.0, 99.0]],
    "q": [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0], [0.5, 0.5, 0.5, 0.5]],
}
SATURATED = {"k": [[0.0, 1e-3], [0.02, 0.0], [0.0, 0.0]], "v": [[0.0, 0.0], [0.5, 0.25], [0.0, 1e-5]], "q": [[0.0] * 4] * 3}


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("kinds", [("k", "v", "q"), ("k", "v")], ids=["with-q", "kv-only"])
def test_scale_table_shows_each_layers_absmax_scale_and_saturation(per_head, kinds):
    layers = [0, 5, 7]
    absmax = {k: torch.tensor(v, dtype=torch.float64) for k, v in ABSMAX.items()}
    # Scales as the max observer makes them, computed here in float64: absmax / 448 (per head, or of the layer's max).
    scales = {k: (a if per_head else a.amax(1)) / E4M3_MAX for k, a in absmax.items() if k in kinds}
    saturated = {k: torch.tensor(v) if per_head else torch.tensor(v).amax(1) for k, v in SATURATED.items() if k in kinds}
    shown_absmax = {k: a if per_head else a.amax(1) for k, a in absmax.items()}

    header, rows = parse_table(scale_table(layers, {k: v.float() for k, v in shown_absmax.items()},
                                           {k: v.float() for k, v in scales.items()}, saturated))
    columns = ["layer"] + [c for k in kinds for c in (f"{k} absmax", f"{k}_scale", f"{k} sat%")]
    positions = [header.find(c) for c in columns]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), header
    assert ("q absmax" in header) == ("q" in kinds)
    for row, layer in zip(rows, layers):
        i = layers.index(layer)
        assert row[0] == layer and len(row) == 1 + 3 * len(kinds)
        for j, k in enumerate(kinds):
            top = max(ABSMAX[k][i])
            got_absmax, got_scale, got_sat = row[1 + 3 * j: 4 + 3 * j]
            assert got_absmax == pytest.approx(top, rel=1e-3, abs=1e-12)
            assert got_scale == pytest.approx(top / E4M3_MAX, rel=1e-3, abs=1e-12)
            assert got_sat == pytest.approx(100 * max(SATURATED[k][i]), abs=1e-3)
