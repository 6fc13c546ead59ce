"""The limits a verify verdict is judged by: a calibration carries them (a recipe may set them) for its short verify,
and ``kvcal verify`` resolves them against the floor it measures. Torch-free, below both: ``config.py`` and
``verification/`` import it."""

import math
from dataclasses import dataclass, fields
from typing import ClassVar


def agreement_limit(floor_top1: float, ratio: float) -> float:
    """The top-1 agreement limit ``ratio`` times as far from the reference as the floor's: ``floor_top1 ** √ratio``.

    Why the square root: for a small error in the logits, KL grows with the error's square while the share of
    predictions it flips grows with its size, so ``ratio`` times the floor's KL is about √ratio times its top-1
    disagreement (1 − floor_top1). Why a power rather than a product: ``1 − √ratio × miss`` reaches 0 for any miss
    over 1/√ratio (a 1.8% floor miss gave a fail limit of 0 at ratio 100: no scheme could fail on top-1); the
    power equals it for small misses (agreement^k ≈ 1 − k·miss) and stays above 0, so the limit can always fire.
    """
    return floor_top1 ** math.sqrt(ratio)


@dataclass
class Thresholds:
    """Pass and fail limits of a verify verdict: KL in nats/token, top-1 agreement as a fraction.

    By default the limits are relative to a measured *floor*: what computing the unquantized model in another
    precision costs on the same sample (bf16 against a float32 reference; ``verify`` measures it). A scheme
    passes within ``floor_pass`` times the floor's KL and fails beyond ``floor_fail`` times, so a verdict means the
    same on a 135M model and a 70B one. Top-1 limits follow the same ratios through ``agreement_limit``. An
    absolute limit that is set (a recipe's or ``--max-kl``...) replaces its relative one; without a floor,
    ``ABSOLUTE`` stands in for the unset ones.

    Attributes:
        max_kl: pass with mean KL to the reference at most this (None: floor_pass × the floor's KL).
        fail_kl: fail with mean KL above this (None: floor_fail × the floor's KL).
        min_top1: pass with top-1 agreement at least this, 0-1 (None: ``agreement_limit`` at floor_pass).
        fail_top1: fail with top-1 agreement below this (None: ``agreement_limit`` at floor_fail).
        floor_pass: pass within this many times the floor (≥ 1).
        floor_fail: fail beyond this many times the floor (≥ floor_pass).
    """

    max_kl: float | None = None
    fail_kl: float | None = None
    min_top1: float | None = None
    fail_top1: float | None = None
    floor_pass: float = 10.0
    floor_fail: float = 100.0

    # Limits used where none is set and no floor was measured (verify --fixed-limits).
    ABSOLUTE: ClassVar[dict[str, float]] = {"max_kl": 0.02, "fail_kl": 0.1, "min_top1": 0.95, "fail_top1": 0.90}
    LIMITS: ClassVar[tuple[str, ...]] = ("max_kl", "fail_kl", "min_top1", "fail_top1")

    def validate(self) -> "Thresholds":
        """Every value a number, the ratios ordered, the set limits in order (pass inside fail); returns self."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.LIMITS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"threshold {f.name} must be a number, got {value!r}")
        if not 1 <= self.floor_pass <= self.floor_fail:
            raise ValueError(f"thresholds must satisfy 1 ≤ floor-pass ≤ floor-fail, got {self.floor_pass} and {self.floor_fail}")
        self._check_order(self.resolve(None) if None in (self.max_kl, self.fail_kl, self.min_top1, self.fail_top1) else self)
        return self

    @staticmethod
    def _check_order(limits: "Thresholds") -> None:
        if not (0 <= limits.max_kl <= limits.fail_kl and 0 <= limits.fail_top1 <= limits.min_top1 <= 1):
            raise ValueError("thresholds must satisfy 0 ≤ max-kl ≤ fail-kl and 0 ≤ fail-top1 ≤ min-top1 ≤ 1")

    def resolve(self, floor: dict | None, predictions: int | None = None) -> "Thresholds":
        """Absolute limits for a verdict: the set ones as they are, the others from ``floor`` (its "kl" and
        "top1": KL times floor_pass/floor_fail, top-1 by ``agreement_limit``), or ``ABSOLUTE``'s when there is no
        floor or it measured no KL at all. ``predictions``: how many next-token predictions the sample holds, so
        that a floor that missed none counts as missing one (the least this sample can tell)."""
        if floor is None or floor["kl"] <= 0:
            derived = dict(self.ABSOLUTE)
        else:
            top1 = min(floor["top1"], 1 - 1 / predictions) if predictions else floor["top1"]
            derived = {"max_kl": self.floor_pass * floor["kl"], "fail_kl": self.floor_fail * floor["kl"],
                       "min_top1": agreement_limit(top1, self.floor_pass), "fail_top1": agreement_limit(top1, self.floor_fail)}
        limits = {name: derived[name] if getattr(self, name) is None else getattr(self, name) for name in self.LIMITS}
        resolved = Thresholds(**limits, floor_pass=self.floor_pass, floor_fail=self.floor_fail)
        # A set limit can cross a derived one (max_kl 0.5 above a floor's fail_kl): the set one wins, the other follows.
        resolved.fail_kl = max(resolved.fail_kl, resolved.max_kl) if self.fail_kl is None else resolved.fail_kl
        resolved.max_kl = min(resolved.max_kl, resolved.fail_kl) if self.max_kl is None else resolved.max_kl
        resolved.fail_top1 = min(resolved.fail_top1, resolved.min_top1) if self.fail_top1 is None else resolved.fail_top1
        resolved.min_top1 = max(resolved.min_top1, resolved.fail_top1) if self.min_top1 is None else resolved.min_top1
        self._check_order(resolved)
        return resolved

    def origin(self) -> dict[str, str]:
        """Where each limit comes from: "set" or "floor" (report.json shows it beside the limits)."""
        return {name: "set" if getattr(self, name) is not None else "floor" for name in self.LIMITS}
