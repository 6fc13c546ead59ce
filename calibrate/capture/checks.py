"""The captured statistics checked before any scale is derived from them: finite, and enough of them."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ..model.layers import AttentionLayer
from .stats import Stats

if TYPE_CHECKING:
    from ..config import CalibrationConfig


def refuse_nonfinite(stats: Stats, layers: list[AttentionLayer]) -> None:
    """NaN or Inf in a captured Q, K or V is an error naming the layers: no scale can cover it."""
    for kind, s in stats.kinds.items():
        bad = (s.nonfinite.sum(1) > 0).nonzero().flatten().tolist()
        if bad:
            names = ", ".join(layers[i].prefix for i in bad)
            raise ValueError(f"{kind} holds NaN or Inf in {names}; the model produces non-finite activations on this data (try --dtype float32)")


def check_finite(stats: Stats, layers: list[AttentionLayer]) -> None:
    """NaN/Inf in activations (of any rank) is an error naming the layers; all-zero layers get the floor and a warning."""
    refuse_nonfinite(stats, layers)
    for kind, s in stats.kinds.items():
        zero = (s.absmax.amax(1) == 0).nonzero().flatten().tolist()
        if zero:
            names = ", ".join(layers[i].prefix for i in zero)
            warnings.warn(f"{kind} is all zero in {names}; writing the floor scale 1e-6 there", stacklevel=3)


def check_enough_tokens(stats: Stats, config: CalibrationConfig) -> None:
    """Refuse to write scales that rest on fewer tokens than asked for (default: one full sequence).

    A few tokens give scales without a word of warning otherwise (a one-line file calibrates on ~3 tokens).
    """
    seen, needed = int(stats.tokens.min()), config.needed_tokens()
    if seen < needed:
        given = f"--min-tokens {needed}" if config.min_tokens is not None else f"one --seq-len {config.data.seq_len} sequence"
        raise ValueError(
            f"the data gave {seen} tokens per layer, fewer than the {needed} needed ({given}); nothing was written: "
            f"add data, or pass --min-tokens {max(seen, 1)} to accept scales from so little"
        )
