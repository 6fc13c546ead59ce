"""What ``kvcal verify`` concludes from its measured numbers: verdicts, paired comparisons, what to serve.

Plain numbers in, sentences out: nothing here runs a model, so every rule can be read (and tested)
on its own. The numbers come from ``verify.scheme_result``; thresholds from ``VerifyConfig``.
"""

import math

import torch

from . import report
from .config import VERIFY_SCHEMES as SCHEMES
from .config import Thresholds
from .model import AttentionLayer

SCHEME_NOTES = {
    "bf16": "reference: no quantization",
    "scale1": "scale 1.0 everywhere: what vLLM uses when a checkpoint has no scales (ModelOpt's fp8_cast)",
    "tensor": "one static scale per layer (--kv-cache-dtype fp8, every backend)",
    "head": "one static scale per layer and head (FA3 on Hopper only)",
    "token": "dynamic scale per token and KV head (--kv-cache-dtype fp8_per_token_head, Triton; queries stay unquantized)",
}


def mean_stderr(values: list[float]) -> tuple[float, float | None]:
    """Mean over sequences and its standard error (None with a single sequence)."""
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std().item() / math.sqrt(len(values)) if len(values) > 1 else None)


def check_measured(name: str, result: dict) -> None:
    """Refuse numbers that cannot come from a real FP8 emulation of a working model.

    Quantizing real activations always changes something: a KL of exactly 0 means the scheme never ran
    (or reference and scheme share a broken model); a layer error of exactly 0 means that layer was not
    quantized, and exactly 1 that its attention output vanished.
    """
    if result["mode"] == "reference":
        return
    if result["kl"] == 0.0:
        raise ValueError(f"scheme {name} measured a KL of exactly 0: its quantization changed nothing, so this verify "
                         "cannot be trusted (is K/V quantization applied twice, or not at all?)")
    stuck = [i for i, e in enumerate(result["layer_rel_error"]) if e in (0.0, 1.0)]
    if stuck:
        raise ValueError(f"scheme {name} measured a per-layer error of exactly 0 or 1 at layer rows {stuck[:5]}: "
                         "those layers were not quantized or lost their output; this verify cannot be trusted")


def judge(result: dict, limits: Thresholds) -> tuple[str, list[str]]:
    """pass / warn / fail against the thresholds; the reference scheme is "reference"."""
    if result["mode"] == "reference":
        return "reference", []
    reasons, verdict = [], "pass"
    kl, top1 = result["kl"], result["top1"]
    if kl > limits.fail_kl or top1 < limits.fail_top1:
        verdict = "fail"
    elif kl > limits.max_kl or top1 < limits.min_top1 or result.get("needle_lost"):
        verdict = "warn"
    if kl > limits.max_kl:
        reasons.append(f"KL {kl:.4g} > {limits.fail_kl if kl > limits.fail_kl else limits.max_kl} nats/token")
    if top1 < limits.min_top1:
        reasons.append(f"top-1 agreement {top1:.3%} < {limits.fail_top1 if top1 < limits.fail_top1 else limits.min_top1:.0%}")
    if result.get("needle_lost"):
        reasons.append(f"the needle found by the reference was lost in {result['needle_lost']} case(s)")
    return verdict, reasons


def compare(a: dict, b: dict) -> tuple[float, float | None, bool]:
    """KL of scheme a minus scheme b, paired by sequence: (mean, stderr or None, significant at 2 s.e.)."""
    diff = [x - y for x, y in zip(a["kl_per_sequence"], b["kl_per_sequence"])]
    mean, se = mean_stderr(diff)
    return mean, se, se is not None and abs(mean) > 2 * se


def recommend(results: dict[str, dict], held: dict, layers: list[AttentionLayer], checkpoint: str) -> tuple[list[str], str]:
    """What to serve, from the measured numbers only: (sentences, vllm serve line)."""
    lines = list(n for n in held["notes"] if "no KV scales" in n)
    ranked = {n: r for n, r in results.items() if r["mode"] != "reference"}
    if "token" in ranked and any(r["quantizes_query"] for r in ranked.values()):
        lines.append("The static schemes here quantize Q as well (as FA3 on Hopper does); token leaves Q unquantized, "
                     "so part of its lead may be Q's: --kv-only compares K and V alone.")

    def versus(a: str, b: str) -> str:
        mean, se, sig = compare(results[a], results[b])
        ka, kb = results[a]["kl"], results[b]["kl"]
        change = f"{a} is {'lower' if ka < kb else 'higher'} by {abs(ka / kb - 1):.0%}" if kb > 0 else ""
        test = "one sequence: not tested" if se is None else ("significant" if sig else "within noise") + f", paired over {len(results[a]['kl_per_sequence'])} sequences"
        return f"{a} vs {b}: KL {ka:.4g} vs {kb:.4g} nats/token; {change} ({test})"

    for a, b in (("token", "tensor"), ("tensor", "scale1"), ("head", "tensor")):
        if a in ranked and b in ranked:
            lines.append(versus(a, b))
    usable = {n: r for n, r in ranked.items() if r["verdict"] != "fail"}
    if not usable:
        lines.append("Every FP8 scheme measured fails the thresholds: keep this model's KV cache in bf16.")
        return lines, f"vllm serve {checkpoint} --kv-cache-dtype auto"
    # The most portable scheme among those with the best verdict; scale 1.0 only as a last resort.
    rank = {"pass": 0, "warn": 1}
    top = min(rank[r["verdict"]] for r in usable.values())
    preference = ["tensor", *[n for n in usable if n not in SCHEMES], "head", "token", "scale1"]
    choice = next(n for n in preference if n in usable and rank[usable[n]["verdict"]] == top)
    r = usable[choice]
    lines.append(f"Recommended: {choice} ({SCHEME_NOTES.get(choice, r['source'])}): KL {r['kl']:.4g} nats/token, "
                 f"perplexity {r['ppl_change']:+.2%}, top-1 agreement {r['top1']:.2%}, verdict {r['verdict']}.")
    for name, other in usable.items():
        if name != choice and compare(other, r)[2] and other["kl"] < r["kl"]:
            lines.append(f"{name} has significantly lower KL than {choice} ({other['kl']:.4g} vs {r['kl']:.4g}); "
                         f"prefer it if that matters more than backend support: {SCHEME_NOTES.get(name, other['source'])}.")
    target = checkpoint
    if r["mode"] == "static" and choice != "scale1" and r["source"] != "checkpoint":
        target = "OUT"
        how = (f"write them with `kvcal export {checkpoint} --out OUT --granularity {choice}`" if choice in SCHEMES
               else f"write {r['source']} into a copy of the checkpoint")
        lines.append(f"These {choice} scales are not in the checkpoint: {how} and serve OUT.")
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
    granularity = {"head": "head", "token": "token"}.get(r["granularity"], "tensor")
    lines.append(report.SERVE_NOTES[granularity])
    return lines, report.serve_command(target, granularity, skip_sliding=skip)
