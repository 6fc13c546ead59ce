"""Whether a checkpoint's KV scales say what its data needs: the one check ``kvcal inspect`` and ``kvcal verify`` share.

The field ships scales that no data asked for: every scale 0 (an llm-compressor export bug, 60 of 60 layers), every
scale 1.0 (ModelOpt's ``fp8_cast``, on purpose), one scale edited to 1e30 or -0.5. ``check_scales`` finds them, per
layer and kind, against the best evidence there is:

    refused        zero, negative, NaN or Inf: vLLM treats the scale as absent or fails
    changed        more than LIE_FACTOR away from what the checkpoint's own kvcal statistics give
    flushes/clips  with no statistics, on a short sample's statistics (verify runs one): the scale stores most of the
                   sample's nonzero values as zero, or saturates most of them
    uncalibrated   every scale is 1.0: the same as no scales (a warning, not an error)

Scales are compared as vLLM keeps them (``read.load_scales``), in the units the checkpoint stores.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..capture.stats import Stats, bin_edges
from ..choices import OUTPUT_CANDIDATES as CANDIDATES
from ..choices import runs_the_model
from ..fp8 import FORMATS, FP8Format
from ..layout import provenance_path, stats_path
from ..model.directory import attention_prefixes, read_json, tensor_names
from ..model.layers import AttentionLayer, ModelSignature
from ..scales.observers import derive_scales
from ..vllm_facts.loaders import quant_method
from .loaders import stored_dtype
from .read import CheckpointScales, load_scales

# How far a scale may lie from what the statistics give before it is named as changed after calibration. The
# reference is the scale kvcal's export writes from these statistics (the recorded observer, granularity, format and
# headroom; for the output observer, the range of the candidates it chooses among), so an untouched output is within a
# hair of it: bf16 storage rounds by 2^-9, and scales kept in e4m3fn units against an e4m3fnuz calibration differ by
# 448/240 ≈ 1.87. A factor of 4 covers both with room, and is far below every edit the field ships (0, 1e30, and 1.0
# where the data asks for ~0.003: 333×).
LIE_FACTOR = 4.0
# A scale flushes or clips "most" of a sample when it does so to more than this fraction of the sample's values.
MOST = 0.5
# Tokens of held-out text verify runs through the model to check scales a checkpoint without statistics holds.
SAMPLE_TOKENS = 256
UNCALIBRATED = "uncalibrated: the same as no scales (every KV-cache scale is 1.0, what vLLM uses when a checkpoint has none)"
EXPORT_HINT = "re-export the scales from the statistics (kvcal export OUT --out NEW)"
SEVERITY = {"refused": "error", "changed": "error", "flushes": "error", "clips": "error", "uncalibrated": "warning"}


@dataclass
class Finding:
    """One scale (or the whole checkpoint, ``layer`` None) that does not say what its data needs."""

    verdict: str  # a key of SEVERITY
    message: str
    layer: int | None = None

    @property
    def severity(self) -> str:
        return SEVERITY[self.verdict]


@dataclass
class Calibration:
    """A kvcal output's statistics and the settings its scales were derived with (provenance's ``scales``)."""

    stats: Stats
    observer: str = "max"
    granularity: str = "tensor"
    fp8_format: str = "e4m3fn"
    headroom: float = 1.0


def read_calibration(directory: str | Path) -> Calibration | None:
    """The statistics a kvcal output carries (kvcal/stats.safetensors) with its recorded observer settings (kvcal's
    defaults where its provenance records none); None without statistics."""
    path = stats_path(directory)
    if not path.is_file():
        return None
    calibration = Calibration(Stats.load(path))
    try:
        recorded = read_json(provenance_path(directory)).get("scales") or {}
    except (OSError, ValueError, AttributeError):
        recorded = {}  # no or damaged provenance: the max observer, as kvcal's default
    if isinstance(recorded.get("observer"), str):
        calibration.observer = recorded["observer"]
    calibration.granularity = {"head": "head"}.get(recorded.get("granularity"), "tensor")
    calibration.fp8_format = recorded.get("fp8_format") if recorded.get("fp8_format") in FORMATS else "e4m3fn"
    calibration.headroom = float(recorded.get("headroom") or 1.0)
    return calibration


def check_scales(found: CheckpointScales, calibration: Calibration | None = None, sample: Stats | None = None,
                 fmt: FP8Format = FORMATS["e4m3fn"]) -> list[Finding]:
    """Every scale of ``found`` that vLLM refuses, that lies about the data, or that holds no calibration at all.

    Args:
        found: the checkpoint's scales as vLLM keeps them.
        calibration: the checkpoint's kvcal statistics and settings, if it carries them.
        sample: statistics of a short held-out sample through the model (verify), used when there is no calibration.
        fmt: the FP8 format the sample's scales are used in.

    Returns:
        The findings, layer by layer; an empty list when every scale fits.
    """
    findings = []
    good: dict[tuple[int, str], torch.Tensor] = {}
    for (index, kind), tensor in sorted(found.tensors.items()):
        name = found.sources[index, kind][-1]
        if not torch.isfinite(tensor).all():
            findings.append(Finding("refused", f"{name} holds NaN or Inf; vLLM's cache breaks", index))
        elif not (tensor > 0).all():
            findings.append(Finding("refused", f"{name} is zero or negative ({tensor.min().item():g}); vLLM treats it as "
                                    "absent or fails", index))
        else:
            good[index, kind] = tensor.flatten().float()
    if len(good) == len(found.tensors) and uncalibrated(good.values()):
        return [Finding("uncalibrated", UNCALIBRATED + (_statistics_give(calibration, good) if calibration else ""))]
    if calibration is not None:
        findings += _against_statistics(found, good, calibration)
    elif sample is not None:
        findings += _against_sample(found, good, sample, fmt)
    return sorted(findings, key=lambda f: -1 if f.layer is None else f.layer)


def uncalibrated(scales) -> bool:
    """Whether every one of ``scales`` (tensors; at least one) is exactly 1.0: the scales vLLM uses when there are none."""
    scales = list(scales)
    return bool(scales) and all((t == 1).all() for t in scales)


def checkpoint_findings(directory: str | Path, files: list[Path], config: dict, quant: dict | None,
                        sample: Callable[[], Stats] | None = None, fmt: FP8Format = FORMATS["e4m3fn"]) -> list[Finding]:
    """``check_scales`` on a checkpoint directory: its scales read from ``files`` (the files vLLM loads) as vLLM keeps
    them (``config`` and ``quant``: its config.json and quantization config), against its kvcal statistics if any, else
    against the statistics ``sample()`` gives, called only when there are scales to hold to them. Verify's check;
    inspect reads the scales itself and calls ``check_scales``."""
    method = quant_method(quant)
    where = {name: path for path in files for name in tensor_names(path)}
    found = load_scales(where, attention_prefixes(list(where)), method, stored=stored_dtype(method, config))
    calibration = read_calibration(directory)
    short = sample() if sample is not None and calibration is None and found.tensors else None
    return check_scales(found, calibration, short, fmt)


@torch.no_grad()
def sample_statistics(model, layers: list[AttentionLayer], sig: ModelSignature, sequences: list[torch.Tensor]) -> Stats:
    """Statistics of the first SAMPLE_TOKENS tokens of ``sequences`` (1-D token tensors) through ``model``: the short
    sample ``check_scales`` holds a checkpoint without statistics to."""
    from ..capture.hooks import run_capture  # here, not at the top: it brings transformers, which inspect never needs

    tokens = torch.cat(sequences)[:SAMPLE_TOKENS]  # [≤ SAMPLE_TOKENS]
    return run_capture(model, layers, [tokens], Stats.empty(sig), chunk_len=SAMPLE_TOKENS, progress=False)


def _band(calibration: Calibration, query_scale: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """kind → (low, high), each [L] or [L, H]: the scales kvcal's export writes from these statistics with the recorded
    settings (low = high), or for the output observer, which picks among CANDIDATES on held-back data, their range."""
    observers = CANDIDATES if runs_the_model(calibration.observer) else (calibration.observer,)
    sets = [derive_scales(calibration.stats.kinds, observer=observer, granularity=calibration.granularity,
                          fmt=FORMATS[calibration.fp8_format], headroom=calibration.headroom, query_scale=query_scale).scales
            for observer in observers]
    return {kind: (torch.stack([s[kind] for s in sets]).amin(0), torch.stack([s[kind] for s in sets]).amax(0)) for kind in sets[0]}


def _against_statistics(found: CheckpointScales, good: dict, calibration: Calibration) -> list[Finding]:
    """Scales more than LIE_FACTOR from what kvcal's export writes from the checkpoint's statistics."""
    rows = {index: row for row, index in enumerate(calibration.stats.signature.layers)}
    band = _band(calibration, "q" in {kind for _, kind in good})
    findings = []
    for (index, kind), scale in good.items():
        if index not in rows or kind not in band:
            continue
        low, high = (b[rows[index]].flatten().double() for b in band[kind])  # [1] or [H]
        if low.numel() != scale.numel():  # per-tensor against per-head: the largest of each
            low, high, scale = low.amax(0, keepdim=True), high.amax(0, keepdim=True), scale.amax(0, keepdim=True)
        ratio = torch.where(scale > high, scale / high, torch.where(scale < low, scale / low, 1.0))  # 1: within the band
        worst = ratio.max().item() if ratio.max() >= 1 / ratio.min() else ratio.min().item()
        if not 1 / LIE_FACTOR <= worst <= LIE_FACTOR:
            expected = _shown(low) if torch.equal(low, high) else f"{_shown(low)}–{_shown(high)}"
            findings.append(Finding("changed", f"{found.sources[index, kind][-1]} is {_shown(scale)}, {worst:.3g}× the "
                                    f"{expected} the checkpoint's kvcal statistics give ({calibration.observer} "
                                    f"observer): changed after calibration (allowed: within {LIE_FACTOR:g}×); {EXPORT_HINT}", index))
    return findings


def _statistics_give(calibration: Calibration, good: dict) -> str:
    """What the statistics give instead of an uncalibrated checkpoint's 1.0, for its message."""
    kinds = sorted({kind for _, kind in good})
    band = _band(calibration, "q" in kinds)
    shown = ", ".join(f"{kind} {band[kind][0].min().item():.3g}–{band[kind][1].max().item():.3g}" for kind in kinds)
    return f"; its kvcal statistics give {shown}: {EXPORT_HINT}"


def _against_sample(found: CheckpointScales, good: dict, sample: Stats, fmt: FP8Format) -> list[Finding]:
    """Scales that store most of a short sample's nonzero K, V or Q values as zero, or saturate most of them."""
    rows = {index: row for row, index in enumerate(sample.signature.layers)}
    edges = bin_edges()  # [NB, 2]
    findings = []
    for (index, kind), scale in good.items():
        if index not in rows:
            continue
        hist = sample.kinds[kind].hist[rows[index]].sum(0).double()  # [NB]: every head
        total = hist.sum().item()
        if total == 0:
            continue
        # Whole bins only, under the head scale that flushes (clips) least: the fractions are lower bounds.
        flushed = hist[(edges[:, 1] <= fmt.min_subnormal / 2 * scale.min().item()) & (edges[:, 0] > 0)].sum().item() / total
        clipped = hist[edges[:, 0] >= fmt.max * scale.max().item()].sum().item() / total
        name, tokens = found.sources[index, kind][-1], int(sample.tokens[rows[index]])
        if flushed > MOST:
            findings.append(Finding("flushes", f"{name} is {_shown(scale)}: it stores {flushed:.0%} of the {kind.upper()} "
                                    f"values of {tokens} held-out tokens as zero (their largest is "
                                    f"{sample.kinds[kind].absmax[rows[index]].max().item():.3g})", index))
        elif clipped > MOST:
            findings.append(Finding("clips", f"{name} is {_shown(scale)}: it saturates {clipped:.0%} of the {kind.upper()} "
                                    f"values of {tokens} held-out tokens at ±{fmt.max:g}× the scale", index))
    return findings


def refuse(findings: list[Finding], checkpoint: str) -> None:
    """Raise ValueError, in one line, on the first error ``check_scales`` found (what verify refuses to judge)."""
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        where = f"layer {first.layer}: " if first.layer is not None else ""
        hint = ("recalibrate (kvcal calibrate), or serve without these scales" if first.verdict in ("flushes", "clips")
                else f"kvcal inspect {checkpoint} lists every one")
        raise ValueError(f"{checkpoint}'s KV scales do not say what its data needs: {where}{first.message}{more}; {hint}")


def _shown(values: torch.Tensor) -> str:
    """A scale for a message: its one value, or the largest of several."""
    return f"{values.max().item():.3g}" + (f" (max of {values.numel()})" if values.numel() > 1 else "")
