"""``kvcal verify``: what a quantized KV cache costs a checkpoint, measured against the unquantized model.

A *scheme* is one way vLLM could store attention's inputs (``choices.VERIFY_SCHEMES``, or a scales file the user names).
Every scheme is emulated as vLLM's cache write does it: FP8 schemes as x / scale, saturated to the format's
finite max, rounded to nearest even, times scale — K and V always, Q too where the backend quantizes queries
(``vllm_facts.caveats.Q_QUANTIZERS``; ``kv_only`` models the Triton/FlashInfer backends); vLLM's other cache dtypes (int8 and int4 per
token-head, nvfp4) by ``kvdtypes``, K and V only.

Cost: one reference forward of the sample (which also runs each scheme's attention on every layer's own inputs,
for the per-layer errors), one forward per scheme with every layer quantized at once, one for the *floor* (the
unquantized model in another precision, what the verdicts are relative to), and for the recommended scheme one
per probed layer left unquantized (plus a reference): about 3 + S + P forwards. The FA3 accumulator model
(``fa3.probe``), the needle probe (``needle.py``) and decode drift (``drift.py``: prompts × generated tokens
decode steps, for the reference and each scheme) are extra; the tails (``tails.py``), KL by context depth (``depth.py``)
and by kind of token (``token_kinds.py``) reuse the passes' per-token KL. What the numbers mean, verdicts and the
recommendation, is ``verdict.py``'s; the memory arithmetic ``capacity.py``'s.
"""

import contextlib
import copy
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..capture.stats import Stats, position_bucket_starts
from ..checkpoint.scale_check import checkpoint_findings, refuse, sample_statistics
from ..checkpoint.write import tensor_bytes, weight_files
from ..data.stream import Layout, iter_sequences, portable_manifest, read_digests
from ..engine.audit import FAILED, AuditResult
from ..engine.delivery import DeliveryResult, audit_and_check
from ..engine.dtypes import EngineDtypes
from ..engine.launch import EngineError, installed_vllm_version
from ..engine.started import check_hooks, emulation_for, shown
from ..files import no_room, read_json_object
from ..fp8 import get_format
from ..hub import snapshot_origin
from ..layout import is_kvcal_output, provenance_path, records_path, stats_path
from ..model.description import ModelDescription, describe
from ..model.directory import prefixes_in
from ..model.layers import AttentionLayer, ModelSignature, attention_layers, checkpoint_named, signature
from ..model.load import check_known_type, check_tokenizer_fits, load_model, load_tokenizer, resolve_device
from ..thresholds import Thresholds
from ..version import kvcal_version
from ..vllm_facts import serving
from ..vllm_facts.caveats import AMX_MLA_AUTO_ONLY
from ..vllm_facts.platforms import PLATFORMS, platform
from ..vllm_facts.platforms import Emulation as Writer
from . import depth, engine, fa3, report, token_kinds
from .capacity import LayerKV, per_token, plan
from .card import PLACEHOLDER, refresh_applied, served_name, write_card
from .config import FLOOR, NEAR_TIE_NATS, REFERENCE, VerifyConfig
from .drift import measure_drift, prompts_from
from .kvdtypes import DTYPES
from .needle import needle_probe
from .passes import ApplyScheme, ReferenceProbe, measure, probe_skip_layers, scheme_result
from .scale1 import EQUAL, WORSE, scale1_answer
from .schemes import TWIN_MARK, Mode, Scheme, build_schemes, floor_scheme, scheme_dtype, target_twins
from .tails import tails
from .verdict import (
    check_measured,
    check_reference,
    choose,
    emulated_figures,
    judge,
    recommend,
    serve_lines,
    target_refusals,
)
from .verdict_table import AUDIT_FAILED, ENGINE_FAILED, NOT_DELIVERED

# ---- the probes ---------------------------------------------------------------------------------------------------


def _fa3(probe: ReferenceProbe, rows: torch.Tensor, schemes: list[Scheme], layers, sig: ModelSignature, config: VerifyConfig) -> dict:
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


# ---- derived results ----------------------------------------------------------------------------------------------


def _kv_layers(model_config, layers: list[AttentionLayer], sig: ModelSignature) -> list[LayerKV]:
    """The attention layers as ``capacity`` sizes them: vLLM's index, KV heads, head size, sliding window."""
    window = getattr(model_config.get_text_config(), "sliding_window", None)
    return [LayerKV(layer.layer_idx, sig.num_kv_heads, sig.head_dim, _value_dim(sig), window if layer.sliding_window else None)
            for layer in layers]


def _value_dim(sig: ModelSignature) -> int:
    """Width of a cached V head: MLA caches no V (the latent row serves both), other models one as wide as K."""
    return 0 if sig.latent_dim else sig.head_dim


def _bytes_of(name: str):
    """``capacity``'s bytes per token of a layer in cache dtype ``name``."""
    return lambda layer: DTYPES[name].bytes_per_token(layer.heads, layer.head_dim, layer.head_dim_v)


def does_it_pay(config: VerifyConfig, kv_layers: list[LayerKV], files: list[Path], results: dict, context: int) -> dict:
    """``capacity.plan`` for bf16 and every measured scheme's cache dtype at ``--max-model-len`` on ``--gpu``."""
    names = dict.fromkeys(["auto", *(r["kv_dtype"] for r in results.values())])
    result = plan(kv_layers, sum(tensor_bytes(f) for f in files), config.max_model_len or context, config.gpu,
                  {name: _bytes_of(name) for name in names}, tp=config.tp)
    return {**result, "gpu": config.gpu}


def skip_cost(kv_layers: list[LayerKV], dtype: str, skip: list[int], context: int) -> dict:
    """KV bytes per token at ``context`` with every layer in ``dtype``, and with the ``skip`` layers in bf16."""
    return {"all_quantized": per_token(kv_layers, _bytes_of(dtype), context),
            "with_skip": per_token(kv_layers, _bytes_of(dtype), context, skip=set(skip), bf16_bytes_of=_bytes_of("auto"))}


# ---- the command --------------------------------------------------------------------------------------------------


# verify's exit status when the answer is incomplete: an engine run failed after the emulation ran (docs/usage.md).
INCOMPLETE = 3
REFERENCE_LOGPROBS = "reference.npy"  # the reference model's log-probabilities, in the engine's temporary folder


@dataclass
class VerifyResult:
    """Every number of a verify run (``report``, as written to report.json) and where the report went."""

    report: dict
    report_dir: Path | None
    checkpoint: str | None = None  # as the user typed it: the terminal's serve line names it, the report does not
    report_error: str | None = None  # why --report's folder was not written (a full disk): the terminal has the answer

    @property
    def schemes(self) -> dict[str, dict]:
        return self.report["schemes"]

    def outcome(self) -> tuple[int, str | None]:
        """The command's exit status and its one-line error (docs/usage.md, "Exit status"): 2 when the report could
        not be written (the terminal's answer is all there is), INCOMPLETE when the engine failed after the emulation
        ran, wholly or in one scheme's run (the report keeps what ran), 1 when the load audit found the engine does not
        hold the checkpoint's scales or the delivery check found the kernel ignores them."""
        if self.report_error:  # first: the folder the user will look for is not there
            return 2, self.report_error
        if self.report.get("engine_error"):
            return INCOMPLETE, ("the engine failed after the emulation ran (its figures alone are reported): "
                                f"{self.report['engine_error']}")
        engine = self.report.get("engine")
        if engine and engine.get("failed"):
            name, why = next(iter(engine["failed"].items()))
            more = f" (and {len(engine['failed']) - 1} more)" if len(engine["failed"]) > 1 else ""
            return INCOMPLETE, f"the answer is incomplete: {name}: {why}{more}"
        if engine and engine["audit"]["failures"]:
            return 1, f"the load audit failed: {engine['audit']['failures'][0]}"
        if engine and engine["delivery"] and not engine["delivery"]["ok"]:
            return 1, f"the delivery check failed: {engine['delivery']['text'].splitlines()[0]}"
        return 0, None

    def summary(self, skip_layers: Sequence[str | int] = (), *, verbose: bool = False, risks: Sequence[str] = ()) -> str:
        """The verdict table and the answer, the serve command last (``report.verify_text``; ``verbose``: with every
        detail report.md holds), for a person; ``skip_layers`` (a recipe's) are added to every serve line, and each
        names the checkpoint as the user typed it; ``risks``: the caller's warnings, weighed for the answer."""

        def local(line: str) -> str:
            return serving.with_skip_layers(line if self.checkpoint is None else serving.with_model(line, self.checkpoint), skip_layers)

        rep = {**self.report, "serve_command": local(self.report["serve_command"]),
               "serve_lines": {t: {**s, "line": local(s["line"])} for t, s in self.report.get("serve_lines", {}).items()}}
        return report.verify_text(rep, report_md=self.report_dir / "report.md" if self.report_dir else None,
                                  verbose=verbose, risks=risks)


@dataclass(frozen=True)
class Subject:
    """The checkpoint verify measures, described once: config.json's facts, the weight files vLLM loads (headers
    checked), whether kvcal wrote it, and the calibration records its sample leaves out. Every step takes this
    instead of reading the directory again."""

    path: str  # as the user typed it
    described: ModelDescription
    files: list[Path]
    prefixes: dict[int, str]  # layer index → attention prefix in those files (``directory.prefixes_in``)
    absolute: Path  # resolved: vLLM runs elsewhere, where a relative path would read as a Hub id
    kvcal_output: bool
    calibration: frozenset[str]  # digests of the records calibration used (empty: none known, or opted in)
    calibration_records: int  # how many it used, for the report (counted even when opted in)
    calibration_known: bool  # the checkpoint says which records calibration used


@dataclass
class Sample:
    """The held-out sequences (exactly seq_len tokens each), their layouts, the data manifest, how many records were
    left out as calibration's, and the decode-drift prompts cut from them."""

    tokenizer: object
    sequences: list[torch.Tensor]
    layouts: list[Layout]
    manifest: list[dict]
    excluded: int
    prompts: list[torch.Tensor]
    prompt_source: str | None


@dataclass
class Reference:
    """The reference model on its device, its attention layers under the checkpoint's names, their signature and the
    checkpoint's kvcal statistics (None: it has none)."""

    model: torch.nn.Module
    device: torch.device
    layers: list[AttentionLayer]
    sig: ModelSignature
    stats: Stats | None


@dataclass
class Emulation:
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


@dataclass
class Judged:
    """Per-scheme results with verdicts, the floor's, the limits they were judged by and the tails' summary."""

    results: dict[str, dict]
    floor: dict | None
    limits: Thresholds
    tails: dict
    others: dict[str, dict[str, dict]]  # target → scheme → its twin's figures and verdict (``_judge_twins``)


@dataclass
class Advice:
    """What the target is told: the recommendation's lines and its serve line, every target's serve line, the layers
    to keep unquantized, what the cache costs and frees, whether scale 1.0 is enough (FP8, nvfp4), the vLLM release said."""

    recommendation: list[str]
    serve: str
    serve_lines: dict[str, dict]
    skip_probe: dict | None
    pays: dict | None
    scale1: dict | None
    scale1_nvfp4: dict | None
    vllm_version: str | None


def _describe(config: VerifyConfig) -> Subject:
    """Read the checkpoint once (config.json, its weight files' headers, kvcal's files) and check every option and
    data source, before anything is loaded."""
    described = describe(config.checkpoint)
    config.validate()
    check_known_type(config.checkpoint, described.config)
    files = weight_files(described)  # vLLM's files, every header checked
    # Scales vLLM refuses, or that lie about the statistics the checkpoint carries: refused as kvcal inspect fails them.
    refuse(checkpoint_findings(config.checkpoint, files, described.config, described.quant), config.checkpoint)
    path = records_path(config.checkpoint)
    if config.include_calibration_data:  # counted for the report only, never checked: opting in must always work
        records = frozenset(path.read_text().split()) if path.is_file() else frozenset()
    else:
        records = read_digests(path)
    return Subject(config.checkpoint, described, files, prefixes_in(files), Path(config.checkpoint).resolve(),
                   is_kvcal_output(config.checkpoint),
                   frozenset() if config.include_calibration_data else records, len(records), path.is_file())


def _sample(config: VerifyConfig, subject: Subject) -> Sample:
    """Whole sequences of exactly seq_len tokens (a shorter last one is dropped) of the records calibration did not
    use, and the drift prompts cut from them; data too short for one sequence is refused before the model loads."""
    data = config.data
    tokenizer = load_tokenizer(config.checkpoint)
    check_tokenizer_fits(config.checkpoint, subject.described.config, tokenizer)
    stream = iter_sequences(data, tokenizer, max_context=subject.described.context, exclude=subject.calibration, layouts=True)
    kept = [(s, layout) for s, layout in zip(list(stream), stream.layouts()) if s.numel() == data.seq_len]
    sequences, layouts = [s for s, _ in kept], [layout for _, layout in kept]
    manifest = stream.manifest()
    excluded = sum(source["records_excluded"] for source in manifest)
    if not sequences and excluded:
        raise ValueError(f"the data holds {stream.tokens_yielded} tokens outside the {excluded} records calibration used, less "
                         f"than one sequence of --seq-len {data.seq_len}: verify on other text (--data), calibrate "
                         "with a smaller --max-tokens, or pass --include-calibration-data")
    if not sequences:
        raise ValueError(f"the data gives {stream.tokens_yielded} tokens, less than one sequence of --seq-len "
                         f"{data.seq_len}; lower --seq-len or add data")
    prompts, source = (prompts_from(sequences, tokenizer.eos_token_id, config.prompts, config.prompt_len)
                       if config.generate else ([], None))
    return Sample(tokenizer, sequences, layouts, manifest, excluded, prompts, source)


def _reference(config: VerifyConfig, subject: Subject, device: torch.device, tokenizer,
               sequences: list[torch.Tensor]) -> Reference:
    """The reference model (float32 on CPU by default, K and V unquantized), its attention layers under the names the
    checkpoint's files give them, and the checkpoint's statistics checked against it; without statistics, its scales
    checked on the first tokens of ``sequences`` (``scale_check.sample_statistics``)."""
    model, _ = load_model(config.checkpoint, device=device, dtype=getattr(torch, config.dtype) if config.dtype else None,
                          tokenizer=tokenizer, config=subject.described.config)
    layers = checkpoint_named(attention_layers(model), subject.prefixes)
    sig = signature(model, layers)
    if sig.latent_dim and config.fa3:
        raise ValueError("--fa3 models FlashAttention-3, which vLLM does not run for latent attention (MLA): drop --fa3")
    path = stats_path(config.checkpoint)
    stats = Stats.load(path) if path.is_file() else None
    if stats is not None:
        stats.signature.check_matches(sig, f"the statistics in {path}")
    else:  # no statistics to hold the scales to: a short held-out sample through the model instead
        refuse(checkpoint_findings(config.checkpoint, subject.files, subject.described.config, subject.described.quant,
                                   lambda: sample_statistics(model, layers, sig, sequences), get_format(config.fp8_format)),
               config.checkpoint)
    return Reference(model, device, layers, sig, stats)


def _emulate(config: VerifyConfig, subject: Subject, ref: Reference, sample: Sample, clock: "Clock") -> Emulation:
    """The schemes (the checkpoint's scales, scales derived from its statistics, named files), the reference pass and
    one pass per scheme, then the optional probes: the FA3 numeric model on sampled rows, the needle, decode drift."""
    fmt = get_format(config.fp8_format)
    schemes, skipped, held = build_schemes(config, subject.described, subject.files, ref.layers, ref.sig, ref.stats, fmt)
    floor = [floor_scheme(ref.model.dtype, fmt)] if config.floor else []
    twins = target_twins(schemes, {target: (w.backend, not w.kv_only) for target, w in other_writers(config).items()})
    rows = fa3.query_rows(config.data.seq_len, config.data.chunk_len, config.fa3_rows) if config.fa3 else None
    tallies, probe, ref_nll, ref_seconds = measure(ref.model, ref.layers, schemes + twins + floor, sample.sequences, config, rows)
    clock.mark("passes")
    fa3_result = _fa3(probe, rows, schemes, ref.layers, ref.sig, config) if config.fa3 else None
    clock.mark("fa3")
    needle_result = (_needle(ref.model, sample.tokenizer, ref.layers, schemes, config, subject.described.context)
                     if config.needle else None)
    clock.mark("needle")
    drifts = (measure_drift(ref.model, ref.layers, schemes + floor, sample.prompts, config.generate, progress=config.progress)
              if sample.prompts else {})
    clock.mark("drift")
    return Emulation(schemes, floor, skipped, held, tallies, probe, ref_nll, ref_seconds, fa3_result, needle_result, drifts,
                     twins)


def _judge(config: VerifyConfig, sample: Sample, emulated: Emulation) -> Judged:
    """Each scheme's numbers; the limits, from the floor unless set; the tails, depth and kinds of token; verdicts."""
    tallies, schemes = emulated.tallies, emulated.schemes
    results = {s.name: scheme_result(s, tallies[s.name], emulated.probe.ref_sq, emulated.ref_nll)
               for s in schemes + emulated.floor}
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
        r["reasons"] += _evidence_reasons(r)
        r["servable"] = name not in not_servable
        if not r["servable"]:
            r["reasons"].append(not_servable[name])
        r["kv_dtype"] = scheme_dtype(next(s for s in schemes if s.name == name))
    return Judged(results, floor_result, limits, tail_result, _judge_twins(emulated, limits))


def other_writers(config: VerifyConfig) -> dict[str, Writer]:
    """Under --engine, each other target's like-for-like writer (its platform's emulation), whose line is chosen on
    the twins measured with it; none without an engine, where one emulation serves every target."""
    if config.engine is None:
        return {}
    return {p.target: p.emulation for p in PLATFORMS.values() if p.target != config.target}


def _judge_twins(emulated: Emulation, limits: Thresholds) -> dict[str, dict[str, dict]]:
    """Each twin's figures, judged by the emulation's limits (without the tails, which are measured for the run's own
    schemes only): target → scheme → {kl, kl_stderr, kl_per_sequence, top1, ppl_change, verdict, reasons}."""
    out: dict[str, dict[str, dict]] = {}
    for twin in emulated.twins:
        name, target = twin.name.split(TWIN_MARK)
        r = scheme_result(twin, emulated.tallies[twin.name], emulated.probe.ref_sq, emulated.ref_nll)
        verdict, reasons = judge({**r, "tails": None, "needle_lost": None}, limits)
        out.setdefault(target, {})[name] = {**{k: r[k] for k in engine.ENGINE_FIGURES if k in r}, "verdict": verdict,
                                            "reasons": reasons}
    return out


class Clock:
    """Seconds since the run started, marked at the end of each step, for the report's timings."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks = {"start": self.start}

    def mark(self, step: str) -> None:
        self.marks[step] = time.perf_counter()

    def between(self, first: str, last: str) -> float:
        return self.marks[last] - self.marks[first]


def verify(checkpoint: str | Path, data: str | Path | list[str], **options) -> VerifyResult:
    """Measure what an FP8 KV cache costs ``checkpoint`` on ``data``, per scheme, and recommend how to serve it.

    ``options`` are flat settings, each going to the part of ``VerifyConfig`` that owns it: ``seq_len``,
    ``max_tokens``, ``chunk_len``, ``text_field``, ``seed`` (the sample), ``max_kl``, ``fail_kl``, ``min_top1``,
    ``fail_top1`` (the thresholds) and VerifyConfig's own fields (schemes, fa3, accum_bits, needle, report_dir...).
    """
    return run_verify(VerifyConfig.from_options(checkpoint, data, **options))


def run_verify(config: VerifyConfig) -> VerifyResult:
    """Run a verify; see ``verify``."""
    clock = Clock()
    # 1. Describe the checkpoint once (config.json, vLLM's weight files, kvcal's records) and check every option and
    # data source, before anything is loaded.
    subject, device = _describe(config), resolve_device(config.device)
    # 2. The engine (--engine), started before anything long: its platform sets the emulation and the target, and the
    # load audit shows it loads this checkpoint, or ends the run in its first minute.
    started = _start_engine(config, subject) if config.engine else None
    clock.mark("engine_start")
    # 3. The held-out sample, before the model is loaded: data too short for one sequence is refused cheaply.
    sample = _sample(config, subject)
    clock.mark("sample")
    # 4. The reference model (float32 on CPU by default, K and V unquantized) and its attention layers.
    ref = _reference(config, subject, device, sample.tokenizer, sample.sequences)
    if started is not None:  # the engine's arrays fit the temporary directory, known before the emulation's passes
        engine.check_room(len(sample.sequences), config.data.seq_len - 1, ref.model.config.get_text_config().vocab_size,
                          ["auto", "auto2", *config.schemes], Path(tempfile.gettempdir()))
    clock.mark("load")
    # 5. Emulate every scheme and the floor as vLLM's cache write does it; the optional probes.
    emulated = _emulate(config, subject, ref, sample, clock)
    # 6. Judge the emulation: limits from the floor unless set, tails, depth, kinds of token, verdicts.
    judged = _judge(config, sample, emulated)
    with _scratch(started) as scratch:
        # 7. The engine runs the same sequences per scheme it serves, the reference model off the GPU while it does;
        # its figures replace the emulation's where it ran.
        engine_result, engine_error = (_run_engine(config, subject, started, ref, sample, emulated, judged, Path(scratch))
                                       if started else (None, None))
        # 8. Recommend for the target, on the figures that decide: what its vLLM refuses, the choice, the layers to
        # keep unquantized, what the cache costs and frees, whether scale 1.0 is enough.
        advice = _recommend(config, subject, ref, sample, emulated, judged, engine_result)
        if started is not None:
            advice.recommendation[:0] = _engine_lines(started, engine_result, engine_error)
        # 8b. The serve line it will print, run as printed in the engine: the answer shows that run's figures. Where
        # its skip layers made it worse than every layer quantized, the next candidate is that line, which the engine
        # already ran: the advice is made again without the skip-layer probe.
        if engine_result is not None:
            served = _run_serve_line(config, subject, started, ref, sample, judged, advice, engine_result, Path(scratch))
            if served.get("against_promised", {}).get("worse"):
                served["skip_probe"] = advice.skip_probe
                advice = _recommend(config, subject, ref, sample, emulated, judged, engine_result, probe=False)
                advice.recommendation[:0] = _engine_lines(started, engine_result, engine_error)
                served["instead"] = advice.serve
            engine_result["serve_run"] = served
    # 9. The report; a kvcal output's model card gets its table.
    rep = _report(config, subject, ref, sample, emulated, judged, advice, engine_result, engine_error, clock)
    out, failed = None, None
    if config.report_dir is not None:
        try:  # both files or neither; a full disk here loses the folder, never the answer the terminal shows
            report.write_verify_report(Path(config.report_dir), rep)
            out = Path(config.report_dir)
        except OSError as e:
            if (why := no_room(e)) is None:
                raise
            failed = (f"the report was not written to {config.report_dir} ({why}; nothing of it is there): free space "
                      "there and run again")
        else:
            _refresh_card(subject, rep)
    return VerifyResult(rep, out, config.checkpoint, failed)


def _recommend(config: VerifyConfig, subject: Subject, ref: Reference, sample: Sample, emulated: Emulation,
               judged: Judged, engine_result: dict | None, probe: bool = True) -> Advice:
    """The recommendation for ``config.target`` and its serve line, every target's serve line, the layers to keep
    unquantized (unless not ``probe``), the cache's bytes and what FP8 frees (``does_it_pay``), and the answer to "is
    scale 1.0 enough?"."""
    results, layers, sig, model_config = judged.results, ref.layers, ref.sig, subject.described.config
    # The serving target's vLLM: a dtype it lacks or serves wrongly is marked so instead of a verdict, never chosen.
    shape = serving.model_shape(vars(sig))
    for name, why in target_refusals(results, config.target, **shape).items():
        results[name]["target_refusal"] = why.short
        reason = f"{why.note} ({'measured' if why.evidence == 'measured' else 'read in the source'}, {serving.build_name(config.target)})"
        if reason not in results[name]["reasons"]:  # made again when the serve line's run sends it back (step 8b)
            results[name]["reasons"].append(reason)
    choice = choose(results)
    skip_probe = None
    if probe and choice is not None and config.probe_layers and len(layers) > 1 and results[choice]["mode"] != Mode.REFERENCE:
        # One baseline: the emulation's all-quantized pass against its passes with a layer left unquantized, even where
        # the engine's figures chose the scheme (an engine/emulation gap is no layer's gain).
        _on_device(ref)
        skip_probe = probe_skip_layers(ref.model, layers, next(s for s in emulated.schemes if s.name == choice),
                                       emulated_figures(results)[choice], sample.sequences, config)
    for r in results.values():
        r["bytes_per_token"] = len(layers) * DTYPES[r["kv_dtype"]].bytes_per_token(sig.num_kv_heads, sig.head_dim, _value_dim(sig))
        r["bytes_vs_bf16"] = (DTYPES[r["kv_dtype"]].bytes_per_token(1, sig.head_dim, _value_dim(sig))
                              / DTYPES["auto"].bytes_per_token(1, sig.head_dim, _value_dim(sig)))
    kv_layers = _kv_layers(ref.model.config, layers, sig)
    pays = does_it_pay(config, kv_layers, subject.files, results, subject.described.context or config.data.seq_len)
    if skip_probe is not None:
        skip_probe["bytes_per_token"] = skip_cost(kv_layers, results[skip_probe["scheme"]]["kv_dtype"], skip_probe["skip"], pays["context"])
    plain = serving.unquantized_dtype(model_config)  # auto, unless a kv_cache_scheme would make auto fp8
    scale1 = scale1_answer(results)
    nvfp4_scale1 = scale1_answer(results, "nvfp4")
    vllm_version = config.vllm_version or installed_vllm_version()  # the release the caveats are said for
    served = served_model(subject)  # the report's serve lines name no local path
    recommendation, serve = recommend(results, emulated.held, layers, checkpoint_name(config.checkpoint), skip_probe, pays,
                                      target=config.target, unquantized=plain,
                                      scale1=" ".join(a["text"] for a in (scale1, nvfp4_scale1) if a) or None,
                                      vllm_version=vllm_version, served=served,
                                      engine_target=engine_result["target"] if engine_result else None,
                                      mla=bool(sig.latent_dim), model_type=model_config.get("model_type"),
                                      scale_one=bool(scale1) and scale1["outcome"] in (EQUAL, WORSE))
    # The engine's figures choose its own target's line; every other target's is the emulation's with that target's
    # writer (its static schemes' twins), said so.
    own = Writer(config.backend, config.dtype, bool(config.kv_only))
    emulation = {target: f"kvcal's emulation, {Writer(w.backend, config.dtype, w.kv_only).flags() if target in judged.others else own.flags()}"
                 for target, w in other_writers(config).items()}
    lines = serve_lines(results, emulated.held, layers, served, skip_probe, unquantized=plain, **shape,
                        engine_target=engine_result["target"] if engine_result else None, emulation=emulation,
                        others=judged.others)
    return Advice(recommendation, serve, lines, skip_probe, pays, scale1, nvfp4_scale1, vllm_version)


def _engine_lines(started: "EngineStart", engine_result: dict | None, engine_error: str | None) -> list[str]:
    """The recommendation's first lines under --engine: a failed audit or delivery, the engine's failure, or which
    figures ranked and judged."""
    return [*(f"{AUDIT_FAILED}{line}" for line in started.audit.failures),
            *([f"{NOT_DELIVERED}{started.delivery.text()}"] if started.delivery and not started.delivery.ok() else []),
            *([f"{ENGINE_FAILED}, which alone is judged here: {engine_error}"] if engine_error else
              [*(f"{ENGINE_FAILED} in {name}: {why}; "
                 + ("the engine's run-to-run noise is unmeasured" if name == "auto2" else "that scheme has no verdict")
                 for name, why in engine_result["failed"].items()),
               f"Ranked and judged on the engine's figures (vLLM {engine_result['vllm_version']}, "
               f"{engine_result['attention_backend']}, target {engine_result['target']}) where it ran a "
               "scheme, the emulation's beside them; docs/engine.md."])]


def _report(config: VerifyConfig, subject: Subject, ref: Reference, sample: Sample, emulated: Emulation, judged: Judged,
            advice: Advice, engine_result: dict | None, engine_error: str | None, clock: Clock) -> dict:
    """report.json's content: every number of the run, no local path."""
    model, config_data, prompts = ref.model, config.data, sample.prompts
    dtype = str(model.dtype).removeprefix("torch.")
    skip_probe, floor_result, limits = advice.skip_probe, judged.floor, judged.limits
    return {
        "kvcal_version": kvcal_version(),
        "caveats_for_vllm": advice.vllm_version,  # the release the recommendation's engine caveats are said for (None: unknown)
        "checkpoint": checkpoint_name(config.checkpoint),  # no local path: the report travels with OUT's card
        "reference": {"name": REFERENCE, "dtype": dtype, "device": str(ref.device),
                      "model": (what := reference_model(subject.described.quant, model, dtype)),
                      "note": f"the reference is the {what} in {dtype}, called {REFERENCE} as vLLM would serve it"},
        "fp8_format": get_format(config.fp8_format).name,
        "backend": config.backend,
        "settings": portable_settings(config.settings()),
        "data": portable_manifest(sample.manifest),
        "sample": {"sequences": len(sample.sequences), "seq_len": config_data.seq_len,
                   "tokens": len(sample.sequences) * config_data.seq_len},
        "held_out": {"calibration_records": subject.calibration_records, "excluded_records": sample.excluded,
                     "include_calibration_data": config.include_calibration_data,
                     "calibration_known": subject.calibration_known},
        "layers": [vars(layer) for layer in ref.layers],
        "checkpoint_scales": emulated.held,
        "floor": floor_result,
        "thresholds": thresholds_json(config.thresholds, limits, floor_result),
        "schemes": judged.results,
        "skip_layers": skip_probe,
        "does_it_pay": advice.pays,
        "skipped": emulated.skipped,
        "fa3": emulated.fa3,
        "needle": emulated.needle,
        "recommendation": advice.recommendation,
        "scale1": advice.scale1,
        "scale1_nvfp4": advice.scale1_nvfp4,
        "target": config.target,
        "serve_command": advice.serve,  # the line for ``target``, printed last
        "serve_lines": advice.serve_lines,  # every target's line, with the vLLM build it was checked against
        "other_targets": judged.others,  # under --engine, the static schemes as each other target's writer runs them
        "engine": engine_result,
        "engine_error": engine_error,  # the engine's failure after the emulation ran (None: it ran, or was not asked)
        "position_profile": _position_profile(ref.stats),
        "tails": {k: v for k, v in judged.tails.items() if k != "schemes"},
        "depth": {"rule": depth.rule(), "first_end": depth.FIRST_END, "growth": depth.GROWTH, "min_sequences": depth.MIN_SEQUENCES},
        "token_kinds": {"rule": token_kinds.rule(), "ratio": token_kinds.RATIO, "min_tokens": token_kinds.MIN_TOKENS},
        "drift": {"steps": config.generate, "prompts": len(prompts), "prompts_asked": config.prompts, "prompt_len": config.prompt_len,
                  "prompt_source": sample.prompt_source, "near_tie_nats": NEAR_TIE_NATS} if prompts else None,
        "timings": {
            "engine_start_s": clock.between("start", "engine_start"),  # describing the checkpoint, and the engine start
            "sample_s": clock.between("engine_start", "sample"), "load_s": clock.between("sample", "load"),
            "passes_s": clock.between("load", "passes"), "reference_pass_s": emulated.ref_seconds,
            "scheme_pass_s": {n: t.seconds for n, t in emulated.tallies.items()},
            "skip_probe_s": skip_probe["seconds"] if skip_probe else 0.0, "fa3_s": clock.between("passes", "fa3"),
            "needle_s": clock.between("fa3", "needle"), "drift_s": clock.between("needle", "drift"),
            "total_s": time.perf_counter() - clock.start,
        },
    }


def thresholds_json(asked: Thresholds, limits: Thresholds, floor: dict | None) -> dict:
    """The limits a set of verdicts used (``limits``, resolved from ``floor``), where each came from, as report.json
    holds them: the emulation's under "thresholds", the engine's under "engine"."""
    return {**{name: getattr(limits, name) for name in Thresholds.LIMITS}, "origin": asked.origin(),
            "floor_pass": limits.floor_pass, "floor_fail": limits.floor_fail,
            "relative_to_floor": floor is not None and floor["kl"] > 0}


def _position_profile(stats: Stats | None) -> dict | None:
    """Absmax by position bucket (max over heads) from the statistics, for the report's position plot."""
    if stats is None:
        return None
    return {
        "bucket_starts": position_bucket_starts(),
        "tokens": stats.pos_tokens.tolist(),  # [L, P]
        **{kind: stats.kinds[kind].pos_absmax.amax(1).tolist() for kind in ("k", "v", "q")},  # [L, P]
    }


def reference_model(quant: dict | None, model: torch.nn.Module, dtype: str) -> str:
    """What the reference is, in words: the unquantized model, or a ``quant_method: fp8`` release's FP8-weight model
    as it is served (transformers runs its e4m3 block weights natively on GPUs that can, and elsewhere, CPU included,
    dequantizes them, e4m3 × block scale, to the load dtype); K and V unquantized either way."""
    if quant is None or quant.get("quant_method") != "fp8":  # quant: the quantization config vLLM uses (quant_config)
        return "unquantized model"
    if any(p.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) for p in model.parameters()):
        return "FP8-weight model as served (quant_method fp8: its e4m3 block weights run natively by transformers)"
    return (f"FP8-weight model as served (quant_method fp8: its e4m3 block weights, the ones vLLM computes with, "
            f"dequantized by transformers to {dtype})")


def checkpoint_name(checkpoint: str) -> str:
    """How the report names the checkpoint verified: its Hub id and revision when it is a Hub snapshot, else its
    folder's name (never a local path)."""
    origin = snapshot_origin(checkpoint)
    return f"{origin['id']}@{origin['revision']}" if origin else Path(checkpoint).resolve().name


def served_model(subject: Subject) -> str:
    """The model the report's serve lines name: a kvcal output's card name (``card.served_name``: its --hub-id, else a
    placeholder), a Hub snapshot's repo id, else the placeholder; the terminal names the checkpoint as typed."""
    if subject.kvcal_output:
        return served_name(read_json_object(provenance_path(subject.path), "calibrate it again"))
    origin = snapshot_origin(subject.path)
    return origin["id"] if origin else PLACEHOLDER


def portable_settings(settings: dict) -> dict:
    """Verify's settings without local paths: scales files and the report folder by name."""
    schemes = [Path(s).name if s.endswith(".safetensors") else s for s in settings["schemes"]]
    return {**settings, "schemes": schemes, "report_dir": settings["report_dir"] and Path(settings["report_dir"]).name}


def _evidence_reasons(r: dict) -> list[str]:
    """What the depth trend and the kinds of token add to a scheme's reasons: damage that grows with depth, and kinds
    much worse than the rest (the verdict itself is the KL's and top-1's)."""
    reasons = []
    if r.get("depth") and r["depth"]["trend"]["verdict"] == "grows":
        reasons.append(f"KL grows with context depth ({depth.trend_text(r['depth'])})")
    if r.get("token_kinds"):
        reasons += token_kinds.worse_text(r["token_kinds"])
    return reasons


@dataclass
class EngineStart:
    """The engine as verify found it before the emulation: where it runs, the load audit, what kvcal set to match it,
    and the cache dtypes it offers."""

    host: engine.EngineHost
    audit: AuditResult
    delivery: DeliveryResult | None  # None: the audit did not pass, so delivery was not asked
    settings: str  # the line saying what kvcal set, and why
    dtypes: EngineDtypes
    facts: dict | None  # what the engine showed of itself at its starts (``engine.started.shown``; None: no start)


def _start_engine(config: VerifyConfig, subject: Subject) -> EngineStart:
    """Find vLLM and its cache dtypes (one import), run the load audit and, where it passed, the delivery check
    (``engine.delivery``: the kernel uses the scales); refuse a release whose engine lacks a hook the jobs need; set the
    emulation and the target like for like with the platform and the attention backend the engine started with
    (``VerifyConfig.match_engine``, said on stderr with the progress). A flag that contradicts the platform, or a vLLM
    that cannot load the checkpoint, ends the run here, in one line, before the emulation's long passes."""
    host = engine.probe(config.vllm_python)
    chosen = platform(host.platform)
    copy.copy(config).match_engine(host.platform, chosen)  # a flag contradicting the platform: refused before any start
    if (chosen.target == "cpu" and host.isa.get("amx") and subject.described.mla
            and serving.unquantized_dtype(subject.described.config) != "auto"):
        raise ValueError(f"{AMX_MLA_AUTO_ONLY}: nothing can be measured in the engine on this host; verify the source "
                         f"model with --engine vllm, or {config.checkpoint} without it")
    checkpoint = subject.absolute
    try:
        held, delivered = audit_and_check(checkpoint, host.python)  # one start serves both
    except EngineError as e:
        raise ValueError(f"the check could not run: vLLM {host.version} on {checkpoint.name} ({e}), so nothing can be "
                         "measured in the engine") from None
    if held.status == FAILED and not held.layers:  # vLLM refused the load itself
        raise ValueError(f"{held.failures[0]}: nothing can be measured in the engine; fix the checkpoint (kvcal inspect "
                         f"{config.checkpoint}), or verify without --engine")
    facts = shown([delivered.engine if delivered else None, held.engine])
    check_hooks(facts, host.version)
    settings = config.match_engine(host.platform, chosen, emulation_for(chosen, facts))
    if config.progress:
        print(f"kvcal: {settings}", file=sys.stderr, flush=True)
    return EngineStart(host, held, delivered, settings, EngineDtypes(host.version, host.cache_dtypes), facts)


def _scratch(started: "EngineStart | None"):
    """The engine's temporary folder (None without an engine): the reference model's log-probabilities stay there from
    the engine's runs (step 7) to the serve line's (8b), so the model computes them once."""
    return tempfile.TemporaryDirectory(prefix="kvcal-engine-") if started else contextlib.nullcontext()


def _off_gpu(ref: Reference, on_gpu: bool) -> None:
    """Move the reference model off the GPU the engine will run on (``on_gpu``): each vLLM start sizes its share of
    the card from the memory free then (``jobs/jobkit.py`` ``device_memory``), which the model would otherwise hold.
    ``_on_device`` moves it back for the emulation's later passes."""
    if on_gpu:
        ref.model.to("cpu")
        torch.cuda.empty_cache()


def _on_device(ref: Reference) -> None:
    """The reference model back on its device, for a pass after the engine ran (the skip-layer probe)."""
    if next(ref.model.parameters()).device != ref.device:
        ref.model.to(ref.device)


def _run_engine(config: VerifyConfig, subject: Subject, started: EngineStart, ref: Reference, sample: Sample,
                emulated: Emulation, judged: Judged, scratch: Path) -> tuple[dict | None, str | None]:
    """The same sequences in the engine, once per scheme it can serve, judged there (``engine.judge_on_engine``); with
    decode drift's prompts, the engine's own greedy decode after each too. The reference model's log-probabilities go
    to ``scratch/reference.npy`` first, then the model leaves the GPU (``_off_gpu``). (result, None), or (None, the
    failure in one line) when the engine failed after the emulation ran, which then stands alone."""
    host, sequences = started.host, sample.sequences
    request, settings = _engine_request(config, subject, started, ref, sample)
    schemes = emulated.schemes
    names = ["auto", "auto2", *(s.name for s in schemes if s.mode != Mode.REFERENCE)]
    targets = torch.stack([s[1:] for s in sequences]).numpy()  # the next tokens, for the engine's perplexity
    try:
        logprobs = engine.reference_logprobs(ref.model, sequences, scratch / REFERENCE_LOGPROBS)
        _off_gpu(ref, platform(host.platform).target != "cpu")
        runs = engine.run_schemes(host, subject.absolute, names, [s.tolist() for s in sequences], **request,
                                  vocab_size=logprobs.shape[-1], workdir=scratch, reference=logprobs, targets=targets)
        del logprobs
        if "npy" in runs.get("auto", {}):  # the serve line's run makes its own unquantized run
            runs["auto"].pop("npy").unlink()
        result = engine.compare(judged.results, runs, {s.name: s.scales for s in schemes if s.scales}, host, settings)
    except (ValueError, EngineError) as e:
        return None, str(e)
    except OSError as e:  # the reference's array met a full disk after check_room: the temporary directory filled
        if (why := no_room(e)) is None:
            raise
        return None, f"writing the reference log-probabilities in {tempfile.gettempdir()} failed: {why}; free space there"
    # The engine's figures are judged against the engine's own floor (its unquantized cache against the reference on
    # the same sequences), as the emulation's are against the emulation's: never one method's KL over the other's floor.
    limits = config.thresholds.resolve(result["floor"], len(sequences) * (config.data.seq_len - 1))
    result["thresholds"] = thresholds_json(config.thresholds, limits, result["floor"])
    engine.judge_on_engine(judged.results, result, limits)
    held = started.audit
    result["audit"] = {"status": held.status, "failures": held.failures, "reason": held.reason,
                       "kv_cache_dtype": held.kv_cache_dtype}
    result["set"], result["not_emulated"] = started.settings, started.dtypes.not_emulated()
    result["at_start"] = started.facts
    result["delivery"] = started.delivery.to_json() | {"text": started.delivery.text()} if started.delivery else None
    return result, None


def _engine_request(config: VerifyConfig, subject: Subject, started: EngineStart, ref: Reference,
                    sample: Sample) -> tuple[dict, dict]:
    """What every engine run of this verify is given (``engine.run_schemes``' settings but the names, the sequences, the
    vocabulary and the folder), and the settings report.json shows."""
    sig, prompts = ref.sig, sample.prompts
    block = config.block_size or platform(started.host.platform).block_size
    longest = max(config.data.seq_len + 1, max((len(p) + config.generate for p in prompts), default=0))
    max_len = config.max_model_len or engine.model_len(longest, block)
    settings = {"max_model_len": max_len, "block_size": block, "dtype": config.dtype, "chunk_len": config.data.chunk_len,
                "prefix_caching": False, "enforce_eager": True}
    request = {"dtype": config.dtype or "auto", "chunk_len": config.data.chunk_len, "max_model_len": max_len,
               "block_size": block, "kv_bytes": engine.kv_cache_bytes(len(ref.layers), sig.num_kv_heads, sig.head_dim, max_len, block),
               "unquantized": serving.unquantized_dtype(subject.described.config), "offered": started.dtypes.names,
               "prompts": [p.tolist() for p in prompts], "steps": config.generate, "tensor_parallel_size": config.tp}
    return request, settings


def _run_serve_line(config: VerifyConfig, subject: Subject, started: EngineStart, ref: Reference, sample: Sample,
                    judged: Judged, advice: Advice, engine_result: dict, scratch: Path) -> dict:
    """The serve line the answer prints, run as printed in the engine (its cache dtype, its skip layers, this
    checkpoint's scales) on the held-out sequences: the scheme's own run where that already is the line, else one run
    with the skip layers beside a fresh unquantized one, against the reference's log-probabilities step 7 left in
    ``scratch``; against the scheme's all-quantized run, flagged when worse beyond the noise (``run_verify`` then
    serves that run's line instead)."""
    choice = advice.serve_lines[config.target]["scheme"]
    dtype, skip = serving.serve_args(advice.serve)
    out = {"line": advice.serve, "scheme": choice, "kv_cache_dtype": dtype, "skip_layers": skip,
           "vllm_version": engine_result["vllm_version"], "attention_backend": engine_result["attention_backend"]}
    if choice is None:
        return {**out, "ran": False, "why": "the line keeps the cache unquantized: the engine's floor is that run"}
    same, why = engine.as_printed(choice, skip, engine_result, subject.absolute)
    promised = engine_result["schemes"][choice]
    if why is not None:
        return {**out, "ran": False, "why": why}
    if same:
        return {**out, "ran": True, "same_run": True, "floor": engine_result["floor"],
                **{k: promised[k] for k in ("kl", "kl_stderr", "top1", "drift")}}
    request, settings = _engine_request(config, subject, started, ref, sample)
    sequences = sample.sequences
    targets = torch.stack([s[1:] for s in sequences]).numpy()
    _off_gpu(ref, platform(started.host.platform).target != "cpu")  # the skip-layer probe brought it back
    try:
        logprobs = np.load(scratch / REFERENCE_LOGPROBS, mmap_mode="r")
        runs = engine.run_schemes(started.host, subject.absolute, ["auto", choice], [s.tolist() for s in sequences],
                                  **request, vocab_size=logprobs.shape[-1], workdir=scratch, skip_layers=skip,
                                  reference=logprobs, targets=targets)
        del logprobs
        result = engine.compare({choice: emulated_figures(judged.results)[choice]}, runs, {}, started.host, settings)
    except (ValueError, EngineError) as e:
        return {**out, "ran": False, "why": f"the engine failed: {e}"}
    except OSError as e:  # the temporary directory filled after check_room
        if (why := no_room(e)) is None:
            raise
        return {**out, "ran": False, "why": f"the engine failed: writing in {tempfile.gettempdir()} failed: {why}"}
    row = result["schemes"][choice]
    if "kl" not in row:
        return {**out, "ran": False, "why": f"the engine failed: {row['why']}"}
    # No "as named" here: the skipped layers' unquantized cache is what the line asks for (the scheme's own run checked
    # the dtype's name on every layer).
    return {**out, "ran": True, "same_run": False, "floor": result["floor"],
            **{k: row[k] for k in ("kl", "kl_stderr", "kl_per_sequence", "top1", "drift")},
            "against_promised": engine.worse_than_promised(row, promised, engine_result["noise_kl"])}


def _refresh_card(subject: Subject, rep: dict) -> None:
    """Rewrite the verify table in the card of a kvcal output, or kvcal's section in that of a pack applied to other
    weights (``card.refresh_applied``); any other card is left alone."""
    checkpoint = subject.path
    try:
        if not subject.kvcal_output:
            refresh_applied(checkpoint, rep)
            return
        write_card(checkpoint, read_json_object(provenance_path(checkpoint), "calibrate it again"), rep)
    except OSError as e:
        warnings.warn(f"{checkpoint}/README.md keeps its old verify table: {e.strerror or e}", stacklevel=3)
