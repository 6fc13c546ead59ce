"""What ``kvcal verify`` concludes from its measured numbers: verdicts, paired comparisons, what to serve.

Plain numbers in, sentences out: nothing here runs a model, so every rule can be read (and tested)
on its own. The numbers come from ``verify.scheme_result``; thresholds from ``VerifyConfig``.
"""

import math

import torch

from ..choices import DEFAULT_TARGET, SCHEMES, TARGETS, scheme_label, scheme_rank
from ..model.layers import AttentionLayer
from ..thresholds import Thresholds
from ..vllm_facts import serving
from ..vllm_facts.caveats import Q_QUANTIZERS
from .config import FLOOR, SKIP_BASELINE, percent
from .kvdtypes import DTYPES
from .significance import mean_stderr, significant
from .tails import COMPARED, CONFIDENCE

# What each scheme is, in a line, for the report and the recommendation.
SCHEME_NOTES = {name: spec.note or f"--kv-cache-dtype {spec.kv_dtype}: {DTYPES[spec.kv_dtype].note}" for name, spec in SCHEMES.items()}
SCHEME_NOTES[FLOOR] = "the unquantized model computed in another precision: what the verdicts are measured against"

# Each scheme's note, from the one table (choices.SCHEMES; a cache dtype's from kvdtypes.DTYPES), and the floor's.


def check_measured(name: str, result: dict) -> None:
    """Refuse numbers that cannot come from a real FP8 emulation of a working model.

    Quantizing real activations always changes something: a KL of exactly 0 means the scheme never ran
    (or reference and scheme share a broken model); a layer error of exactly 0 means that layer was not
    quantized, and exactly 1 that its attention output vanished.
    """
    if result["mode"] in ("reference", "floor"):  # the floor may cost nothing measurable (Thresholds.resolve)
        return
    if result["kl"] == 0.0:
        raise ValueError(f"scheme {name} measured a KL of exactly 0: its quantization changed nothing, so this verify "
                         "cannot be trusted (is K/V quantization applied twice, or not at all?)")
    stuck = [i for i, e in enumerate(result["layer_rel_error"]) if e in (0.0, 1.0)]
    if stuck:
        raise ValueError(f"scheme {name} measured a per-layer error of exactly 0 or 1 at layer rows {stuck[:5]}: "
                         "those layers were not quantized or lost their output; this verify cannot be trusted")


# The measurements a verdict rests on: each must be a finite number, or there is no verdict.
JUDGED = ("kl", "top1", "nll")
NOT_FINITE = "not finite"  # the verdict of a scheme whose measurements are NaN or Inf: never chosen nor recommended
# The verdict of a scheme whose engine run crashed, was killed, timed out or ran out of memory or disk
# (``judgment.judge_engine``): the emulation's stays beside it, never in its place; never chosen nor recommended.
RUN_FAILED = "engine run failed"


def non_finite(result: dict, layer_ids: list[int] | None = None) -> str | None:
    """Which of a scheme's measurements are NaN or Inf, and at which layers (``layer_ids``: the index of each row of
    ``layer_rel_error``; None: rows), for a person; None when all are finite.

    Every comparison with NaN is false, so a NaN KL would pass every threshold: it must be caught before judging.
    """
    bad = [f"{name} {result[name]}" for name in JUDGED if name in result and not math.isfinite(result[name])]
    rows = [i for i, e in enumerate(result.get("layer_rel_error", [])) if not math.isfinite(e)]
    if rows:
        named = [layer_ids[i] for i in rows] if layer_ids is not None else rows
        bad.append(f"per-layer error at {'layers' if layer_ids is not None else 'layer rows'} {named[:5]}")
    return ", ".join(bad) or None


def check_reference(ref_nll: list[float], floor: dict | None) -> None:
    """Refuse a verify whose unquantized model itself computed NaN or Inf (an fp16 overflow, damaged weights): every
    scheme is measured against it, so no verdict would mean anything."""
    if not all(math.isfinite(x) for x in ref_nll):
        raise ValueError("the unquantized reference model computed a non-finite loss (NaN or Inf), so no scheme can be "
                         "judged against it: an fp16 overflow? run verify with --dtype float32 (or bfloat16)")
    if floor is not None and (why := non_finite(floor)):
        raise ValueError(f"the floor (the unquantized model computed in another precision) went non-finite ({why}): an "
                         "fp16 overflow? run verify with --dtype float32, or without the floor (--fixed-limits)")


def judge(result: dict, limits: Thresholds) -> tuple[str, list[str]]:
    """pass / warn / fail against the thresholds; the reference scheme is "reference"; NOT_FINITE when a measurement
    is NaN or Inf (it would pass every comparison)."""
    if result["mode"] == "reference":
        return "reference", []
    if (why := non_finite(result)) is not None:
        return NOT_FINITE, [f"measured non-finite numbers: {why}; this scheme has no verdict and is never recommended"]
    reasons, verdict = [], "pass"
    kl, top1 = result["kl"], result["top1"]
    if kl > limits.fail_kl or top1 < limits.fail_top1:
        verdict = "fail"
    elif kl > limits.max_kl or top1 < limits.min_top1 or result.get("needle_lost"):
        verdict = "warn"
    if kl > limits.max_kl:
        reasons.append(f"KL {kl:.4g} > {limits.fail_kl if kl > limits.fail_kl else limits.max_kl:.3g} nats/token")
    if top1 < limits.min_top1:
        reasons.append(f"top-1 agreement {top1:.3%} < {percent(limits.fail_top1 if top1 < limits.fail_top1 else limits.min_top1)}")
    if result.get("needle_lost"):
        reasons.append(f"the needle found by the reference was lost in {result['needle_lost']} case(s)")
    tail = (result.get("tails") or {}).get("vs_floor")
    if tail and tail["heavier"]:  # the tail rule (tails.tail_rule): a heavy tail keeps a scheme from passing
        verdict = "warn" if verdict == "pass" else verdict
        lo, hi = tail["interval"]
        reasons.append(f"{COMPARED} per-token KL {tail['ratio']:.3g}× the floor's ({CONFIDENCE:.0%} interval {lo:.3g}–{hi:.3g}×) "
                       f"> {tail['limit']:g}×")
    return verdict, reasons


def compare(a: dict, b: dict) -> tuple[float, float | None, bool]:
    """KL of scheme a minus scheme b, paired by sequence: (mean, stderr or None, significant by
    ``significance.significant``). Two schemes measured apart (one in the engine, ``measured_by``, the other by the
    emulation) have KLs against different unquantized runs: no paired test between them (stderr None)."""
    diff = [x - y for x, y in zip(a["kl_per_sequence"], b["kl_per_sequence"])]
    mean, se = mean_stderr(diff)
    if a.get("measured_by") != b.get("measured_by"):
        return mean, None, False
    return mean, se, significant(mean, se, len(diff))


def _servable(r: dict) -> bool:
    """Served as measured: from this checkpoint (``servable``) and by the serving target's vLLM (no ``target_refusal``)."""
    return r.get("servable", True) and not r.get("target_refusal")


def target_refusals(results: dict[str, dict], target: str, *, mla: bool = False,
                    head_size: int | None = None) -> dict[str, serving.Support]:
    """The schemes ``target``'s vLLM does not serve as measured (a dtype it lacks or serves wrongly, per-head scales
    it does not read, a dtype it refuses for this model's MLA or head size): name → the row that says why
    (``serving.refusal``). Needs each result's ``kv_dtype``."""
    return {n: why for n, r in results.items() if r["mode"] != "reference"
            and (why := serving.refusal(target, r["kv_dtype"], per_head=r["granularity"] == "head", mla=mla,
                                        head_size=head_size))}


def serve_lines(results: dict[str, dict], held: dict, layers: list[AttentionLayer], checkpoint: str,
                skip_probe: dict | None = None, *, unquantized: str = "auto", mla: bool = False,
                head_size: int | None = None, engine_target: str | None = None, emulation: dict[str, str] | None = None,
                others: dict[str, dict[str, dict]] | None = None) -> dict[str, dict]:
    """The serve line for every target, each chosen among the schemes that target's vLLM serves as measured for this
    model (``target_refusals``): target → {"scheme": name or None (bf16), "label": its ``choices.scheme_label``,
    "kv_dtype", "line", "build": the vLLM build its facts were read in, and under an engine "evidence": whose figures
    chose it}.

    An engine's figures (``engine_target``: the target whose engine judged ``results``, ``judgment.judge_engine``)
    choose its own target's line only: every other target's is chosen on the emulation's figures and verdicts
    (``emulated_figures``), with its static schemes' figures and verdicts as that target's writer gave them where
    ``others`` holds them (target → scheme → the twin's, ``schemes.target_twins``), its evidence "emulated for
    <target>" with the emulation's settings (``emulation``: target → words), so a kernel of one platform never
    changes another's line. Without an engine there is no evidence key: every line is the emulation's."""
    out = {}
    for target in TARGETS:
        own = engine_target is None or target == engine_target
        figures = results if own else {name: {**r, **(others or {}).get(target, {}).get(name, {})}
                                       for name, r in emulated_figures(results).items()}
        refused = target_refusals(figures, target, mla=mla, head_size=head_size)
        judged = {n: {**r, "target_refusal": refused[n].short if n in refused else None} for n, r in figures.items()}
        _, line = recommend(judged, held, layers, checkpoint, skip_probe, target=target, unquantized=unquantized)
        scheme = choose(judged)
        out[target] = {"scheme": scheme, "label": scheme_label(scheme) if scheme else None,
                       "kv_dtype": judged[scheme]["kv_dtype"] if scheme else unquantized, "line": line,
                       "build": serving.build_name(target)}
        if engine_target is not None:
            out[target]["evidence"] = ("the engine's figures where it ran a scheme" if own
                                       else f"{EMULATED_FOR}{target}" + (f" ({emulation[target]})" if emulation else ""))
    return out


EMULATED_FOR = "emulated for "  # the evidence of a target's line the engine did not run, before the target's name


def emulated_figures(results: dict[str, dict]) -> dict[str, dict]:
    """``results`` as the emulation measured and judged them: where an engine's figures replaced a scheme's
    (``judgment.judge_engine`` keeps the emulation's under ``emulated``), the emulation's figures, verdict and
    reasons back."""
    out = {}
    for name, r in results.items():
        if "emulated" not in r:
            out[name] = r
            continue
        out[name] = {**{k: v for k, v in r.items() if k not in ("emulated", "measured_by")}, **r["emulated"]}
    return out


def choose(results: dict[str, dict]) -> str | None:
    """The scheme to serve: the best verdict first; within it, the lowest KL, where a scheme the paired test does not
    find significantly worse than the lowest counts as level with it, and the most portable of those (the lowest
    ``choices.scheme_rank``) is chosen. None when every one fails."""
    rank = {"pass": 0, "warn": 1}
    usable = {n: r for n, r in results.items() if r["mode"] != "reference" and r["verdict"] in rank and _servable(r)}
    if not usable:
        return None
    top = min(rank[r["verdict"]] for r in usable.values())
    best = {n: r for n, r in usable.items() if rank[r["verdict"]] == top}
    lowest = min(best.values(), key=lambda r: r["kl"])
    level = [n for n, r in best.items() if r is lowest or not _significantly_above(r, lowest)]
    return min(level, key=scheme_rank)


def _significantly_above(a: dict, b: dict) -> bool:
    """Whether scheme a's KL is significantly above b's, paired by sequence (``compare``; one sequence: never)."""
    mean, _, significant = compare(a, b)
    return significant and mean > 0


def rank_correlation(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation of two equal-length lists (None under 3 points or with a constant list)."""
    if len(x) < 3:
        return None
    rx, ry = (torch.tensor(v, dtype=torch.float64).argsort().argsort().double() for v in (x, y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    return None if denominator == 0 else (rx @ ry / denominator).item()


# What both sides of the skip-layer probe's gains are measured by: one method, whatever judged the scheme.


def skip_choice(kl: float, measured: list[dict], num_layers: int) -> dict:
    """Which measured layers to keep unquantized, and how far the cheap estimate agreed with the measurement.

    A layer is worth keeping when leaving it unquantized removes at least twice its fair share of the scheme's
    KL (2 · KL / layers) and that gain is significant (``significance.significant``, paired over ``m["sequences"]``);
    with one sequence there is no test and the share alone decides.
    """
    share = 2 * kl / num_layers
    keep = [m["layer"] for m in measured if m["gain"] > share
            and (m["gain_stderr"] is None or significant(m["gain"], m["gain_stderr"], m["sequences"]))]
    estimate, gain = [m["estimate"] for m in measured], [m["gain"] for m in measured]
    top_agrees = bool(measured) and max(measured, key=lambda m: m["estimate"]) is max(measured, key=lambda m: m["gain"])
    return {"skip": keep, "share_limit": share, "rank_correlation": rank_correlation(estimate, gain), "top_agrees": top_agrees}


def skip_lines(probe: dict) -> list[str]:
    """The skip-layer finding, for a person."""
    best = max(probe["measured"], key=lambda m: m["gain"])
    rho = probe["rank_correlation"]
    lines = [f"Layers kept in bf16 ({scheme_label(probe['scheme'])}, measured end to end for {len(probe['measured'])} of "
             f"{len(probe['layers'])} layers, ranked by each layer's own error; {probe.get('baseline', SKIP_BASELINE)}): "
             f"the largest gain is layer {best['layer']}, KL {probe['kl']:.4g} → {best['kl_without']:.4g}; "
             f"estimate and measurement {'agree' if probe['top_agrees'] else 'disagree'} on the top layer"
             + (f" (rank correlation {rho:.2f})." if rho is not None else ".")]
    if probe["skip"]:
        cost = probe.get("bytes_per_token")
        memory = (f"; the KV cache grows from {cost['all_quantized']:,.0f} to {cost['with_skip']:,.0f} bytes per token "
                  f"({cost['with_skip'] / cost['all_quantized'] - 1:+.0%})" if cost else "")
        lines.append(f"Keep layer{'s' if len(probe['skip']) > 1 else ''} {' '.join(map(str, probe['skip']))} in bf16 "
                     f"(--kv-cache-dtype-skip-layers): each, measured alone, removes over twice an average layer's share "
                     f"of the KL{memory}.")
    else:
        lines.append("No layer stands out: keeping any one in bf16 gains less than twice an average layer's share of the KL.")
    return lines


def pays_lines(pays: dict, dtype: str, verdict: str) -> list[str]:
    """Whether the recommended cache dtype pays at the planned context: capacity and decode bytes against bf16."""
    row, auto = pays["dtypes"][dtype], pays["dtypes"]["auto"]
    where = f"At {pays['context']:,} tokens per sequence on {pays['gpu']}" + (f" × {pays['tp']} (tensor parallel)" if pays["tp"] > 1 else "")
    if row["max_sequences"] == 0:
        return [f"{where}, not one sequence fits beside the weights even in {dtype}: more GPUs or a shorter --max-model-len."]
    lines = [f"{where}: {dtype} holds {row['max_sequences']} full-length sequences where bf16 holds {auto['max_sequences']}, "
             f"and a decoded token reads {row['decode_ratio']:.2f}× the bytes of bf16 at batch 1 (weights + KV; memory-bound "
             "arithmetic, not a measured speed)."]
    if auto["max_sequences"] >= 1 and verdict != "pass":
        lines.append(f"If {auto['max_sequences']} concurrent sequences of this length are enough for your load, bf16 fits them "
                     f"already: {dtype} would buy capacity you do not use at a measured cost ({verdict}); keep bf16 then.")
    elif auto["max_sequences"] == 0:
        lines.append(f"bf16 fits no full-length sequence beside the weights; {dtype} is what makes this context servable here.")
    return lines


def evidence_text(r: dict) -> str:
    """A scheme's figures in words, saying who measured them: the engine (``measured_by``, with the emulation's beside
    them) or kvcal's emulation."""
    figures = (f"KL {r['kl']:.4g} nats/token, perplexity {r['ppl_change']:+.2%}, top-1 agreement {r['top1']:.2%}, "
               f"verdict {r['verdict']}")
    if "measured_by" not in r:
        return f"{figures}, measured by kvcal's emulation"
    e = r["emulated"]
    return (f"{figures}, measured in {r['measured_by']} (kvcal's emulation: KL {e['kl']:.4g}, top-1 {e['top1']:.2%}, "
            f"verdict {e['verdict']})")


def floor_of(r: dict, floor: dict | None, engine: dict | None) -> tuple[float | None, str]:
    """The floor KL a scheme's KL is set against, and whose it is: the engine's (its unquantized cache against the
    reference on the same sequences, ``engine["floor"]``) where the engine measured the scheme (``measured_by``),
    else the emulation's (``floor``). The KL is None where that floor measured none."""
    if "measured_by" in r:
        own, whose = (engine or {}).get("floor"), "the engine's floor"
    else:
        own, whose = floor, "the emulation's floor" if engine else "the floor"
    return (own["kl"] if own and own["kl"] > 0 else None), whose


def short_evidence(r: dict, floor: tuple[float | None, str]) -> str:
    """``evidence_text`` in a few words for the terminal's answer: KL as a multiple of the floor's (``floor``:
    ``floor_of``'s KL and whose; the KL itself without one), top-1, drift, verdict, and who measured it."""
    floor_kl, whose = floor
    kl = f"KL {r['kl'] / floor_kl:.3g}× {whose}" if floor_kl else f"KL {r['kl']:.3g} nats/token"
    drift = r.get("drift")
    drift_text = "" if drift is None else f", drift {drift['agreement']:.0%} agree"
    who = ("emulated by kvcal" if "measured_by" not in r else
           f"measured in {r['measured_by']} (emulated: KL {r['emulated']['kl']:.3g}, top-1 {r['emulated']['top1']:.1%})")
    return f"{kl}, top-1 {r['top1']:.1%}{drift_text}, {r['verdict']}; {who}"


def recommend(results: dict[str, dict], held: dict, layers: list[AttentionLayer], checkpoint: str,
              skip_probe: dict | None = None, pays: dict | None = None, *, target: str = DEFAULT_TARGET,
              unquantized: str = "auto", scale1: str | None = None, vllm_version: str | None = None,
              served: str | None = None, engine_target: str | None = None, mla: bool = False,
              model_type: str | None = None, scale_one: bool = False) -> tuple[list[str], str]:
    """What to serve on ``target``, from the measured numbers only: (sentences, vllm serve line). ``checkpoint``: how
    the sentences name it (an export from it); ``served``: the model the serve line names (default ``checkpoint``). A scheme with a
    ``target_refusal`` is never recommended; ``skip_probe`` counts only when it probed the scheme chosen;
    ``unquantized``: the dtype that keeps this checkpoint's cache unquantized (``serving.unquantized_dtype``);
    ``scale1``: the answer to "is scale 1.0 enough?" (``scale1.scale1_answer``), said right after the checkpoint's notes;
    ``vllm_version``: the release the engine caveats are said for (``vllm_facts.caveats.applying``); ``engine_target``: the
    target whose engine judged the verdicts (``verify --engine``), so a scheme it ran there is not called unrun and its
    figures are the engine's (``judgment.judge_engine``); ``mla`` and ``model_type``: the model's, for the caveats
    that depend on them (``vllm_facts.caveats.applying``); ``scale_one``: the scale-1.0 answer says 1.0 is enough (a
    recommendation that serves 1.0 counts too)."""
    lines = [*held.get("serving", []), *(n for n in held["notes"] if "no KV scales" in n), *([scale1] if scale1 else [])]
    ranked = {n: r for n, r in results.items() if r["mode"] != "reference"}
    if "token" in ranked and any(r["quantizes_query"] for r in ranked.values()):
        lines.append(f"The static schemes here quantize Q as well (as {Q_QUANTIZERS} does); fp8_per_token_head leaves Q unquantized, "
                     "so part of its lead may be Q's: --kv-only compares K and V alone.")

    def versus(a: str, b: str) -> str:
        mean, se, sig = compare(results[a], results[b])
        ka, kb = results[a]["kl"], results[b]["kl"]
        change = f"{scheme_label(a)} is {'lower' if ka < kb else 'higher'} by {abs(ka / kb - 1):.0%}"  # kb ≠ 0: check_measured
        paired = f", paired over {len(results[a]['kl_per_sequence'])} sequences"
        apart = results[a].get("measured_by") != results[b].get("measured_by")
        test = ("measured apart (engine and emulation): not tested" if apart else "one sequence: not tested" if se is None
                else ("significant" if sig else "within noise") + paired)
        return f"{scheme_label(a)} vs {scheme_label(b)}: KL {ka:.4g} vs {kb:.4g} nats/token; {change} ({test})"

    broken = {n: r for n, r in ranked.items() if r["verdict"] == NOT_FINITE}
    for name, r in broken.items():
        lines.append(f"{scheme_label(name)} measured non-finite numbers ({non_finite(r, [layer.layer_idx for layer in layers])}): it has "
                     "no verdict and is never recommended.")
    for a, b in (("token", "tensor"), ("tensor", "scale1"), ("head", "tensor"), ("tensor", "max"), ("tensor", "mse")):
        if a in ranked and b in ranked and a not in broken and b not in broken:
            lines.append(versus(a, b))
    usable = {n: r for n, r in ranked.items() if r["verdict"] in ("pass", "warn") and _servable(r)}
    choice = choose(results)
    if choice is None:
        refused = [n for n, r in ranked.items() if r.get("target_refusal")]
        lines.append("Every quantized scheme measured fails the thresholds"
                     + (f" or is not served as measured on target {target} ({', '.join(map(scheme_label, refused))})" if refused else "")
                     + ": keep this model's KV cache in bf16.")
        lines += serving.caveats(target, unquantized, vllm_version=vllm_version, mla=mla)
        return lines, serving.serve_command(served or checkpoint, unquantized, target=target)
    if skip_probe is not None and skip_probe["scheme"] != choice:
        skip_probe = None
    r = usable[choice]
    lines.append(f"Recommended: {scheme_label(choice)} ({SCHEME_NOTES.get(choice, r['source'])}): {evidence_text(r)}.")
    for name, other in usable.items():
        if name != choice and compare(other, r)[2] and other["kl"] < r["kl"]:
            lines.append(f"{scheme_label(name)} has significantly lower KL than {scheme_label(choice)} ({other['kl']:.4g} vs {r['kl']:.4g}); "
                         f"prefer it if that matters more than backend support: {SCHEME_NOTES.get(name, other['source'])}.")
    smaller = [n for n, o in usable.items() if o["bytes_per_token"] < r["bytes_per_token"] and o["verdict"] == r["verdict"]]
    if smaller:
        lines.append("Smaller caches with the same verdict: " + "; ".join(
            f"{scheme_label(n)} ({usable[n]['bytes_per_token'] / r['bytes_per_token']:.2f}× the bytes, KL {usable[n]['kl']:.4g})" for n in smaller) + ".")
    path = served or checkpoint
    if r["mode"] != "token" and r["granularity"] in ("tensor", "head") and r["source"] not in ("checkpoint", "1.0"):
        path = serving.EXPORT_FIRST
        observer = f" --observer {choice}" if choice in SCHEMES and SCHEMES[choice].scales == "observer" else ""
        how = (f"write them with `kvcal export {checkpoint} --out {path} --granularity {r['granularity']}{observer}`" if choice in SCHEMES
               else f"write {r['source']} into a copy of the checkpoint")
        lines.append(f"Its scales ({scheme_label(choice)}) are not in the checkpoint: {how} and serve {path}.")
    if choice == "scale1" and held["granularity"] is not None:
        lines.append("Scale 1.0 needs a checkpoint without KV scales; this one has scales, which vLLM would use instead.")
    sliding = [i for i, layer in enumerate(layers) if layer.sliding_window]
    skip = False
    if sliding and len(sliding) < len(layers):
        err = torch.tensor(r["layer_rel_error"])
        full = [i for i in range(len(layers)) if i not in sliding]
        skip = err[sliding].mean() > 1.5 * err[full].mean()
        lines.append(f"Sliding-window layers: mean per-layer error {err[sliding].mean():.3g} vs {err[full].mean():.3g} on full layers; "
                     + ("keeping them in bf16 (--kv-cache-dtype-skip-layers sliding_window) should help — judged per layer, not measured end to end."
                        if skip else "skipping them is not indicated."))
    if skip_probe is not None:
        lines += skip_lines(skip_probe)
    if pays is not None:
        lines += pays_lines(pays, r["kv_dtype"], r["verdict"])
    granularity = {"head": "head", "token": "token"}.get(r["granularity"], "tensor")
    if r["kv_dtype"] in ("fp8", "fp8_per_token_head"):  # other dtypes' notes are in the Recommended line already
        lines.append(serving.SERVE_NOTES[granularity])
    lines += serving.caveats(target, r["kv_dtype"], vllm_version=vllm_version, per_head=granularity == "head",
                             checkpoint_scales=held["granularity"] is not None, mla=mla, model_type=model_type,
                             scale_one=scale_one or r["source"] == "1.0")
    if not (engine_target == target and "measured_by" in r):  # judged on the target's engine: it was run
        lines += serving.unrun(target, r["kv_dtype"])
    skip_layers = ([serving.SLIDING] if skip else []) + (skip_probe["skip"] if skip_probe else [])
    return lines, serving.serve_command(path, r["kv_dtype"], target=target, per_head=granularity == "head", skip_layers=skip_layers)
