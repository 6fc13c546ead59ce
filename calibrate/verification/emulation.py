"""verify's emulation: every scheme and the floor run as vLLM's cache write does it, then the optional probes.

The schemes (the checkpoint's scales, scales derived from its statistics, named files) and, under ``--engine``, the
static ones as each other target's writer runs them (``schemes.target_twins``); one reference pass and one pass per
scheme (``passes.measure``); the FA3 accumulator model on sampled rows, the needle, decode drift.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..fp8 import get_format
from ..model.layers import ModelSignature
from ..vllm_facts.platforms import PLATFORMS
from ..vllm_facts.platforms import Emulation as Writer
from . import fa3
from .config import REFERENCE, VerifyConfig
from .drift import measure_drift
from .needle import needle_probe
from .passes import ApplyScheme, ReferenceProbe, measure
from .reference import Reference
from .sample import Sample
from .schemes import Mode, Scheme, build_schemes, floor_scheme, target_twins
from .subject import Subject


@dataclass(frozen=True)
class Emulated:
    """What the emulated passes measured: the schemes run (and the floor), those skipped, what the checkpoint holds,
    the tallies, the reference pass's probe, NLL and time, and the optional probes' results."""

    schemes: list[Scheme]
    floor: list[Scheme]
    skipped: dict
    held: dict
    tallies: dict
    probe: ReferenceProbe
    ref_nll: list[float]
    ref_seconds: float
    fa3: dict | None
    needle: dict | None
    drifts: dict
    twins: list[Scheme]  # the static schemes as the other targets' writers run them (``schemes.target_twins``)


def emulate(config: VerifyConfig, subject: Subject, ref: Reference, sample: Sample, mark: Callable[[str], None],
            keep: Callable[[int, int, int, torch.Tensor], None] | None = None) -> Emulated:
    """The schemes, the reference pass and one pass per scheme, then the optional probes; ``mark`` is told the end of
    each part ("passes", "fa3", "needle", "drift") for the report's timings; ``keep`` is handed the reference pass's
    log-probabilities, for the engine's runs (``passes.measure``)."""
    fmt = get_format(config.fp8_format)
    schemes, skipped, held = build_schemes(config, subject.described, subject.files, ref.layers, ref.sig, ref.stats, fmt)
    floor = [floor_scheme(ref.model.dtype, fmt)] if config.floor else []
    twins = target_twins(schemes, {target: (w.backend, not w.kv_only) for target, w in other_writers(config).items()})
    rows = fa3.query_rows(config.data.seq_len, config.data.chunk_len, config.fa3_rows) if config.fa3 else None
    tallies, probe, ref_nll, ref_seconds = measure(ref.model, ref.layers, schemes + twins + floor, sample.sequences, config, rows,
                                                   keep, [twin.name for twin in twins])
    mark("passes")
    fa3_result = _fa3(probe, rows, schemes, ref.layers, ref.sig, config) if config.fa3 else None
    mark("fa3")
    needle_result = (_needle(ref.model, sample.tokenizer, ref.layers, schemes, config, subject.described.context)
                     if config.needle else None)
    mark("needle")
    drifts = (measure_drift(ref.model, ref.layers, schemes + floor, sample.prompts, config.generate, progress=config.progress)
              if sample.prompts else {})
    mark("drift")
    return Emulated(schemes, floor, skipped, held, tallies, probe, ref_nll, ref_seconds, fa3_result, needle_result, drifts,
                    twins)


def other_writers(config: VerifyConfig) -> dict[str, Writer]:
    """Under --engine, each other target's like-for-like writer (its platform's emulation), whose line is chosen on
    the twins measured with it; none without an engine, where one emulation serves every target."""
    if config.engine is None:
        return {}
    return {p.target: p.emulation for p in PLATFORMS.values() if p.target != config.target}


def _fa3(probe: ReferenceProbe, rows: torch.Tensor, schemes: list[Scheme], layers, sig: ModelSignature,
         config: VerifyConfig) -> dict:
    """``fa3.probe`` on the rows the reference pass captured, for every static scheme."""
    return fa3.probe(
        probe.capture, rows, {s.name: s.scales for s in schemes if s.mode == Mode.STATIC}, get_format(config.fp8_format),
        layer_idx=[layer.layer_idx for layer in layers], groups=sig.num_heads // sig.num_kv_heads, head_dim=sig.head_dim,
        accum_bits=config.accum_bits, unmodelled=[s.name for s in schemes if s.mode == Mode.TOKEN],
    )


def _needle(model, tokenizer, layers, schemes: list[Scheme], config: VerifyConfig, context: int | None) -> dict:
    """``needle.needle_probe`` under each scheme's end-to-end hook, the reference first when not among the schemes."""
    row_of = {layer.layer_idx: row for row, layer in enumerate(layers)}
    runs = schemes if any(s.mode == Mode.REFERENCE for s in schemes) else [Scheme(REFERENCE, Mode.REFERENCE, "", schemes[0].fmt), *schemes]
    return needle_probe(
        model, tokenizer, {s.name: ApplyScheme(s, row_of) for s in runs}, reference=REFERENCE, lengths=config.needle,
        depths=config.needle_depths, data=config.data, context=context, progress=config.progress,
    )
