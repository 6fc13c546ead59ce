"""The tails of per-token KL: the few positions a quantized cache changes most, which a mean hides.

Per scheme: the 99th and 99.9th percentiles of per-token KL(reference ‖ scheme) over the sample, each reported only
when at least ``MIN_BEYOND`` tokens lie beyond it (a percentile of fewer is one or two tokens' value, not a tail), the
maximum, and the share of positions whose top-1 changes where the reference's top-1 was clear (led by more than
``NEAR_TIE_NATS``). Schemes are compared by a seeded bootstrap over sequences (positions of one sequence are not
independent; sequences are): the same resampled sequences for every scheme, so each comparison is paired. A bootstrap
over few sequences draws from too few distinct resamples and its intervals are too narrow: simulated with a tail
exactly on the limit (sequences differing 2.7× in level), it called the tail heavier 48%, 21% and 14% of the time at
1, 2 and 3 sequences, 5.8% at 12 and 4.7% at 16. So no interval is given, and nothing judged, under ``MIN_SEQUENCES``
(tests/verification/test_tails.py checks at most 5% at 1, 2, 3 and 16).

Plain numbers in, numbers out (numpy): nothing here runs a model.
"""

import math

import numpy as np
import torch

from .config import NEAR_TIE_NATS
from .significance import too_few

MIN_BEYOND = 10  # tokens that must lie beyond a percentile for it to be reported
PERCENTILES = {"p99": 99.0, "p99.9": 99.9}
COMPARED = "p99"  # the percentile the bootstrap compares between schemes and against the floor
RESAMPLES = 1000  # bootstrap resamples of the sample's sequences
_BOOTSTRAP_ELEMENTS = 1 << 24  # float64 values one batch of resamples holds (128 MiB), whatever the sample's size
MIN_SEQUENCES = 16  # sequences the bootstrap needs to give intervals and judge a tail (module docstring)
CONFIDENCE = 0.95  # two-sided: the comparison's interval runs from the 2.5th to the 97.5th percentile of resamples


def tokens_needed(percentile: float) -> int:
    """The sample size (tokens) at which ``MIN_BEYOND`` tokens lie beyond ``percentile`` (0-100)."""
    return math.ceil(round(MIN_BEYOND / (1 - percentile / 100), 6))  # rounded: 1 − 99.9/100 is not 0.001 in binary


def _values(token_kl: torch.Tensor) -> np.ndarray:
    """Every measured position's KL of a [sequences, positions] tensor (NaN marks no position), float64."""
    x = token_kl.double().flatten().numpy()
    return x[~np.isnan(x)]


def tail_values(token_kl: torch.Tensor) -> dict:
    """The percentiles and maximum of per-token KL [sequences, positions] (nats), a percentile None when too few
    tokens lie beyond it (``not_reported`` says why and what would do)."""
    x = _values(token_kl)
    out: dict = {"tokens": int(x.size), "not_reported": {}}
    for name, q in PERCENTILES.items():
        if x.size >= tokens_needed(q):
            out[name] = float(np.percentile(x, q))
        else:
            out[name] = None
            out["not_reported"][name] = f"n/a: sample too small, needs {tokens_needed(q):,} tokens"
    out["max"] = float(x.max()) if x.size else None
    return out


def bootstrap(token_kl: dict[str, torch.Tensor], percentile: float, seed: int, resamples: int = RESAMPLES) -> dict[str, np.ndarray]:
    """``percentile`` of per-token KL of every scheme over ``resamples`` resamples of the sequences (with replacement,
    the same ones for every scheme): name → [resamples] float64."""
    sequences = {t.shape[0] for t in token_kl.values()}
    if len(sequences) != 1:
        raise ValueError(f"schemes measured over different numbers of sequences ({sorted(sequences)}) cannot be paired")
    n = sequences.pop()
    picks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [B, S] sequence indices
    out = {}
    for name, t in token_kl.items():
        x = t.double().numpy()  # [S, P], NaN past a shorter sequence's end
        quantile = np.nanpercentile if np.isnan(x).any() else np.percentile
        per_batch = max(1, _BOOTSTRAP_ELEMENTS // x.size)  # resamples at a time: memory per_batch × S × P
        values = []
        for start in range(0, resamples, per_batch):
            pooled = x[picks[start : start + per_batch]].reshape(-1, x.size)  # [b, S·P]
            values.append(quantile(pooled, percentile, axis=1))
        out[name] = np.concatenate(values)
    return out


def ratio_interval(a: np.ndarray, b: np.ndarray) -> tuple[float, float] | None:
    """The ``CONFIDENCE`` interval of a / b over paired resamples; None when b is 0 in some resample."""
    if (b <= 0).any():
        return None
    lo, hi = np.percentile(a / b, [50 * (1 - CONFIDENCE), 100 - 50 * (1 - CONFIDENCE)])
    return float(lo), float(hi)


def tails(token_kl: dict[str, torch.Tensor], clear_flips: dict[str, list[tuple[int, int]]], *, seed: int,
          floor: str | None = None, floor_pass: float | None = None, resamples: int = RESAMPLES) -> dict:
    """Every scheme's tails, and their comparisons.

    Args:
        token_kl: scheme → per-token KL [sequences, positions] (``passes.Tally.token_kl``).
        clear_flips: scheme → per sequence (top-1 changed, positions) where the reference's top-1 was clear.
        seed: the bootstrap's seed (the sample's: the same run gives the same intervals).
        floor, floor_pass: the floor's name among ``token_kl`` and the verdicts' pass factor; with both, each scheme's
            ``COMPARED`` percentile is set against ``floor_pass`` × the floor's (``vs_floor``, what the verdict reads;
            under ``MIN_SEQUENCES`` sequences its ``interval`` and ``heavier`` are None: too few to tell).

    Returns:
        {"schemes": name → tail_values + "clear_flips" (share) + "clear_positions" + "vs_floor",
         "comparisons": every pair's ratio of ``COMPARED`` with its interval (None under ``MIN_SEQUENCES``),
         "too_few": why no interval was given (None when there were enough sequences), and the settings used}.
    """
    schemes = {name: tail_values(t) for name, t in token_kl.items()}
    for name, r in schemes.items():
        flipped, clear = (sum(c) for c in zip(*clear_flips[name])) if clear_flips[name] else (0, 0)
        r["clear_flips"], r["clear_positions"] = (flipped / clear if clear else None), clear
        r["vs_floor"] = None
    reportable = [name for name, r in schemes.items() if r[COMPARED] is not None]
    sequences = min((t.shape[0] for t in token_kl.values()), default=0)
    few = too_few(sequences, MIN_SEQUENCES)
    comparisons = []
    if len(reportable) > 1:
        boot = None if few else bootstrap({n: token_kl[n] for n in reportable}, PERCENTILES[COMPARED], seed, resamples)
        for i, a in enumerate(reportable):
            for b in reportable[i + 1 :]:
                interval = None if boot is None else ratio_interval(boot[a], boot[b])
                comparisons.append({"a": a, "b": b, "ratio": _ratio(schemes[a][COMPARED], schemes[b][COMPARED]), "interval": interval})
        if floor in reportable and floor_pass is not None:
            for name in reportable:
                interval = None if boot is None or name == floor else ratio_interval(boot[name], boot[floor])
                if name != floor and (few or interval is not None):  # below the minimum: the ratio alone, judged by nothing
                    schemes[name]["vs_floor"] = {"ratio": _ratio(schemes[name][COMPARED], schemes[floor][COMPARED]), "interval": interval,
                                                 "limit": floor_pass, "heavier": None if few else interval[0] > floor_pass}
    return {"schemes": schemes, "comparisons": comparisons, "compared": COMPARED, "min_beyond": MIN_BEYOND,
            "min_sequences": MIN_SEQUENCES, "sequences": sequences, "too_few": few,
            "resamples": resamples, "seed": seed, "confidence": CONFIDENCE, "near_tie_nats": NEAR_TIE_NATS}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def tail_rule(floor_pass: float) -> str:
    """How tails count in a verdict, in words a user reads (the thresholds line)."""
    return (f"tails: a scheme whose {COMPARED} per-token KL is above {floor_pass:g}× the floor's, with "
            f"{CONFIDENCE:.0%} bootstrap confidence over sequences, is at best warn (judged on samples of at least "
            f"{MIN_SEQUENCES} sequences and {tokens_needed(PERCENTILES[COMPARED]):,} tokens; under {MIN_SEQUENCES} "
            "sequences, too few sequences to tell)")
