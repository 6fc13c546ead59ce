"""verify's judgment: each scheme's figures, the limits they are judged by, and a verdict with its reasons.

The emulation is judged against the emulation's floor (``judge_emulation``); where the engine ran a scheme, its
figures take the emulation's place and are judged against the engine's own floor (``judge_engine``), never one
method's KL over the other's floor. Each returns a new ``Judged``: the emulation's verdicts stay as they were, and the
engine's carry them under ``emulated``.
"""

import math
from dataclasses import dataclass, replace

from ..thresholds import Thresholds
from . import depth, token_kinds
from .config import FLOOR, VerifyConfig
from .emulation import Emulated
from .engine import ENGINE_FIGURES, NOT_AS_NAMED
from .passes import scheme_result
from .sample import Sample
from .schemes import TWIN_MARK, Mode, scheme_dtype
from .tails import tails
from .verdict import RUN_FAILED, SCHEME_NOTES, check_measured, check_reference, judge


@dataclass(frozen=True)
class Judged:
    """Per-scheme results with verdicts, the floor's, the limits they were judged by and the tails' summary."""

    results: dict[str, dict]
    floor: dict | None
    limits: Thresholds
    tails: dict
    others: dict[str, dict[str, dict]]  # target → scheme → its twin's figures and verdict (``_judge_twins``)


def judge_emulation(config: VerifyConfig, sample: Sample, emulated: Emulated) -> Judged:
    """Each scheme's numbers; the limits, from the floor unless set; the tails, depth and kinds of token; verdicts."""
    tallies, schemes = emulated.tallies, emulated.schemes
    results = {s.name: {**scheme_result(s, tallies[s.name], emulated.probe.ref_sq, emulated.ref_nll),
                        "note": SCHEME_NOTES.get(s.name, "static scales from a file")} for s in schemes + emulated.floor}
    for name, r in results.items():
        check_measured(name, r)
    check_reference(emulated.ref_nll, results.get(FLOOR))  # NaN or Inf there: nothing can be judged against it
    floor_result = results.pop(FLOOR, None)
    limits = config.thresholds.resolve(floor_result, len(sample.sequences) * (config.data.seq_len - 1))
    measured_kl = {n: t for n, t in tallies.items()  # the quantized schemes and the floor; a non-finite one has no verdict
                   if (n == FLOOR or n in results and results[n]["mode"] != Mode.REFERENCE) and math.isfinite(t.token_kl.sum())}
    tail_result = tails({n: t.token_kl for n, t in measured_kl.items()}, {n: t.clear_flips for n, t in measured_kl.items()},
                        seed=config.data.seed, floor=FLOOR if floor_result else None, floor_pass=limits.floor_pass)
    for name, r in [*results.items(), *([(FLOOR, floor_result)] if floor_result else [])]:
        r["tails"], r["drift"] = tail_result["schemes"].get(name), emulated.drifts.get(name)
        t = measured_kl.get(name)
        r["depth"] = depth.by_depth(t.token_kl, t.token_top1, sample.layouts) if t is not None else None
        r["token_kinds"] = token_kinds.by_kind(t.token_kl, t.token_top1, sample.layouts) if t is not None else None
    not_servable = emulated.held["not_servable"]
    for name, r in results.items():
        if emulated.needle and r["mode"] != Mode.REFERENCE:
            r["needle_lost"] = emulated.needle["summary"][name]["lost"]
        r["verdict"], r["reasons"] = judge(r, limits)
        r["reasons"] += evidence_reasons(r)
        r["servable"] = name not in not_servable
        if not r["servable"]:
            r["reasons"].append(not_servable[name])
        r["kv_dtype"] = scheme_dtype(next(s for s in schemes if s.name == name))
    return Judged(results, floor_result, limits, tail_result, _judge_twins(emulated, limits))


def engine_limits(config: VerifyConfig, engine: dict, sequences: int) -> Thresholds:
    """The limits the engine's figures are judged by: resolved from the engine's own floor (its unquantized cache
    against the reference on the same ``sequences``), as the emulation's are from the emulation's."""
    return config.thresholds.resolve(engine["floor"], sequences * (config.data.seq_len - 1))


def judge_engine(judged: Judged, engine: dict, limits: Thresholds) -> Judged:
    """The engine's figures decide where it measured a scheme: its KL, top-1 and perplexity change take the
    emulation's place (kept under ``emulated``, with the emulated verdict and reasons), so that the ranking, the
    recommendation, "is scale 1.0 enough?", report.json and the card all rest on them; judged on them against
    ``limits`` (``engine_limits``); and flagged where the engine and the emulation disagree beyond the tolerance, rank
    otherwise, or the dtype is not what its name says. ``measured_by`` names the engine on each such scheme."""
    flipped = {n for pair in engine["ranking_flips"] for n in pair}
    label = f"vLLM {engine['vllm_version']} engine ({engine['attention_backend']})"
    rows = engine["schemes"]
    return replace(judged, results={name: _on_engine(r, rows[name], label, name in flipped, limits) if name in rows else r
                                    for name, r in judged.results.items()})


def _on_engine(r: dict, row: dict, label: str, flipped: bool, limits: Thresholds) -> dict:
    """One scheme's result with the engine's run of it (``row``) in the emulation's place: a new dict."""
    if row.get("failed"):  # no verdict rests on the emulation in the engine's place: the row says the run failed
        return {**r, "emulated": {"verdict": r["verdict"]}, "verdict": RUN_FAILED, "reasons": [row["why"], *r["reasons"]]}
    if "kl" not in row:
        return {**r, "reasons": [*r["reasons"], f"not measured in the engine: {row['why']}"]}
    out = {**r, "emulated": {**{key: r[key] for key in ENGINE_FIGURES if key in r}, "verdict": r["verdict"],
                             "reasons": r["reasons"]},
           **{key: row[key] for key in ENGINE_FIGURES if row.get(key) is not None}, "measured_by": label}
    verdict, reasons = judge({**out, "tails": None, "needle_lost": None}, limits)
    reasons = [f"engine: {why}" for why in reasons]
    if not row["as_named"]:
        verdict = "fail"
        reasons.append(f"engine stores {NOT_AS_NAMED}: {'; '.join(row['stored']['reasons'])}")
    if row["within_tolerance"] is False:
        reasons.append(f"engine KL {row['kl']:.4g} vs emulated {row['emulated_kl']:.4g} (ratio {row['ratio']:.3g}×): "
                       f"outside the measured tolerance ±{row['tolerance_kl']:.2g}")
    if flipped:
        reasons.append("the engine ranks this scheme differently from the emulation")
    return {**out, "verdict": verdict, "reasons": reasons}


def thresholds_json(asked: Thresholds, limits: Thresholds, floor: dict | None) -> dict:
    """The limits a set of verdicts used (``limits``, resolved from ``floor``), where each came from, as report.json
    holds them: the emulation's under "thresholds", the engine's under "engine"."""
    return {**{name: getattr(limits, name) for name in Thresholds.LIMITS}, "origin": asked.origin(),
            "floor_pass": limits.floor_pass, "floor_fail": limits.floor_fail,
            "relative_to_floor": floor is not None and floor["kl"] > 0}


def evidence_reasons(r: dict) -> list[str]:
    """What the depth trend and the kinds of token add to a scheme's reasons: damage that grows with depth, and kinds
    much worse than the rest (the verdict itself is the KL's and top-1's)."""
    reasons = []
    if r.get("depth") and r["depth"]["trend"]["verdict"] == "grows":
        reasons.append(f"KL grows with context depth ({depth.trend_text(r['depth'])})")
    if r.get("token_kinds"):
        reasons += token_kinds.worse_text(r["token_kinds"])
    return reasons


def _judge_twins(emulated: Emulated, limits: Thresholds) -> dict[str, dict[str, dict]]:
    """Each twin's figures, judged by the emulation's limits (without the tails, which are measured for the run's own
    schemes only, as are the per-layer errors: ``passes.measure``'s ``end_to_end_only``): target → scheme → {kl,
    kl_stderr, kl_per_sequence, top1, ppl_change, verdict, reasons}."""
    out: dict[str, dict[str, dict]] = {}
    for twin in emulated.twins:
        name, target = twin.name.split(TWIN_MARK)
        r = scheme_result(twin, emulated.tallies[twin.name], emulated.probe.ref_sq, emulated.ref_nll)
        verdict, reasons = judge({**r, "tails": None, "needle_lost": None}, limits)
        out.setdefault(target, {})[name] = {**{k: r[k] for k in ENGINE_FIGURES if k in r}, "verdict": verdict,
                                            "reasons": reasons}
    return out
