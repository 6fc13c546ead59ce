"""``kvcal verify``: what a quantized KV cache costs a checkpoint, measured against the unquantized model.

A *scheme* is one way vLLM could store attention's inputs (``choices.VERIFY_SCHEMES``, or a scales file the user names).
Every scheme is emulated as vLLM's cache write does it: FP8 schemes as x / scale, saturated to the format's
finite max, rounded to nearest even, times scale — K and V always, Q too where the backend quantizes queries
(FA3 on Hopper; ``kv_only`` models the Triton/FlashInfer backends); vLLM's other cache dtypes (int8 and int4 per
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

import math
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import serving
from ..capture.stats import Stats, position_bucket_starts
from ..checkpoint.write import tensor_bytes, weight_files
from ..data.config import DataConfig
from ..data.stream import Layout, iter_sequences, portable_manifest, read_digests
from ..engine.audit import FAILED, OK, AuditResult, audit
from ..engine.caveats import installed_vllm_version
from ..engine.delivery import DeliveryResult, check_delivery
from ..engine.dtypes import EngineDtypes, engine_dtypes
from ..engine.launch import EngineError
from ..engine.platforms import platform
from ..files import read_json_object
from ..fp8 import get_format
from ..hub import snapshot_origin
from ..layout import is_kvcal_output, provenance_path, records_path, stats_path
from ..model.description import describe
from ..model.layers import AttentionLayer, ModelSignature, attention_layers, checkpoint_named, signature
from ..model.load import check_known_type, check_tokenizer_fits, load_model, load_tokenizer, resolve_device
from ..thresholds import Thresholds
from ..version import kvcal_version
from . import depth, engine, fa3, report, token_kinds
from .capacity import LayerKV, per_token, plan
from .card import PLACEHOLDER, refresh_applied, served_name, write_card
from .config import FLOOR, NEAR_TIE_NATS, REFERENCE, VerifyConfig
from .drift import measure_drift, prompts_from
from .kvdtypes import DTYPES
from .needle import needle_probe
from .passes import ApplyScheme, ReferenceProbe, measure, probe_skip_layers, scheme_result
from .scale1 import scale1_answer
from .schemes import Mode, Scheme, build_schemes, floor_scheme, scheme_dtype
from .tails import tails
from .verdict import check_measured, check_reference, choose, judge, recommend, serve_lines, target_refusals
from .verdict_table import AUDIT_FAILED, ENGINE_FAILED, NOT_DELIVERED

# ---- scales: from the checkpoint, its statistics, or a file --------------------------------------------------------


# ---- the passes ---------------------------------------------------------------------------------------------------


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


@dataclass
class VerifyResult:
    """Every number of a verify run (``report``, as written to report.json) and where the report went."""

    report: dict
    report_dir: Path | None
    checkpoint: str | None = None  # as the user typed it: the terminal's serve line names it, the report does not

    @property
    def schemes(self) -> dict[str, dict]:
        return self.report["schemes"]

    def outcome(self) -> tuple[int, str | None]:
        """The command's exit status and its one-line error: 2 when the engine failed after the emulation ran (the
        report keeps what ran), 1 when the load audit found the engine does not hold the checkpoint's scales."""
        if self.report.get("engine_error"):
            return 2, f"the engine failed after the emulation ran (its figures alone are reported): {self.report['engine_error']}"
        engine = self.report.get("engine")
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


def _load_stats(directory: Path, sig: ModelSignature) -> Stats | None:
    """The checkpoint's kvcal statistics, checked against the model, or None when it has none."""
    path = stats_path(directory)
    if not path.is_file():
        return None
    stats = Stats.load(path)
    stats.signature.check_matches(sig, f"the statistics in {path}")
    return stats


def _sample(data_config: DataConfig, tokenizer, context: int | None,
            exclude: frozenset[str]) -> tuple[list[torch.Tensor], list[Layout], list[dict], int]:
    """Whole sequences of exactly seq_len tokens (a shorter last one is dropped) of the records not in ``exclude``,
    their layouts (records and kinds of token), the data manifest, and how many records were left out for being in
    ``exclude``."""
    stream = iter_sequences(data_config, tokenizer, max_context=context, exclude=exclude, layouts=True)
    kept = [(s, layout) for s, layout in zip(list(stream), stream.layouts()) if s.numel() == data_config.seq_len]
    sequences, layouts = [s for s, _ in kept], [layout for _, layout in kept]
    manifest = stream.manifest()
    excluded = sum(source["records_excluded"] for source in manifest)
    if not sequences and excluded:
        raise ValueError(f"the data holds {stream.tokens_yielded} tokens outside the {excluded} records calibration used, less "
                         f"than one sequence of --seq-len {data_config.seq_len}: verify on other text (--data), calibrate "
                         "with a smaller --max-tokens, or pass --include-calibration-data")
    if not sequences:
        raise ValueError(f"the data gives {stream.tokens_yielded} tokens, less than one sequence of --seq-len "
                         f"{data_config.seq_len}; lower --seq-len or add data")
    return sequences, layouts, manifest, excluded


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


def verify(checkpoint: str | Path, data: str | Path | list[str], **options) -> VerifyResult:
    """Measure what an FP8 KV cache costs ``checkpoint`` on ``data``, per scheme, and recommend how to serve it.

    ``options`` are flat settings, each going to the part of ``VerifyConfig`` that owns it: ``seq_len``,
    ``max_tokens``, ``chunk_len``, ``text_field``, ``seed`` (the sample), ``max_kl``, ``fail_kl``, ``min_top1``,
    ``fail_top1`` (the thresholds) and VerifyConfig's own fields (schemes, fa3, accum_bits, needle, report_dir...).
    """
    return run_verify(VerifyConfig.from_options(checkpoint, data, **options))


def run_verify(config: VerifyConfig) -> VerifyResult:
    """Run a verify; see ``verify``."""
    start = time.perf_counter()
    # 1. Cheap checks of the checkpoint (its config.json, read once for every step below), every option and data
    # source, before the model is loaded.
    described = describe(config.checkpoint)
    config.validate()
    fmt = get_format(config.fp8_format)
    files = weight_files(described)  # vLLM's files, every header checked
    # 2. The engine (--engine), started before anything long: its platform sets the emulation and the target, and the
    # load audit shows it loads this checkpoint, or ends the run in its first minute.
    started = _start_engine(config) if config.engine else None

    # 3. The sample, before the model is loaded: data too short for one sequence is refused cheaply.
    device = resolve_device(config.device)
    model_config = described.config
    check_known_type(config.checkpoint, model_config)
    context = described.context
    tokenizer = load_tokenizer(config.checkpoint)
    check_tokenizer_fits(config.checkpoint, model_config, tokenizer)
    # A kvcal output's own calibration records are left out unless asked for: the sample is then held out.
    path = records_path(config.checkpoint)
    if config.include_calibration_data:  # counted for the report only, never checked: opting in must always work
        calibration = frozenset(path.read_text().split()) if path.is_file() else frozenset()
    else:
        calibration = read_digests(path)
    sequences, layouts, manifest, excluded = _sample(config.data, tokenizer, context,
                                            frozenset() if config.include_calibration_data else calibration)
    prompts, prompt_source = (prompts_from(sequences, tokenizer.eos_token_id, config.prompts, config.prompt_len)
                              if config.generate else ([], None))
    sampled = time.perf_counter()

    # 4. The reference model (float32 on CPU by default, K and V unquantized) and its attention layers.
    model, _ = load_model(config.checkpoint, device=device, dtype=getattr(torch, config.dtype) if config.dtype else None,
                          tokenizer=tokenizer, config=model_config)
    layers = checkpoint_named(attention_layers(model), config.checkpoint)
    sig = signature(model, layers)
    if sig.latent_dim and config.fa3:
        raise ValueError("--fa3 models FlashAttention-3, which vLLM does not run for latent attention (MLA): drop --fa3")
    loaded = time.perf_counter()

    # 5. Schemes (the checkpoint's scales, scales derived from its statistics, named files), then the reference
    # pass and one pass per scheme.
    stats = _load_stats(Path(config.checkpoint), sig)
    schemes, skipped, held = build_schemes(config, described, files, layers, sig, stats, fmt)
    floor = [floor_scheme(model.dtype, fmt)] if config.floor else []
    fa3_rows = fa3.query_rows(config.data.seq_len, config.data.chunk_len, config.fa3_rows) if config.fa3 else None
    tallies, probe, ref_nll, ref_seconds = measure(model, layers, schemes + floor, sequences, config, fa3_rows)
    measured = time.perf_counter()

    # 6. Optional probes: the FA3 numeric model on sampled rows, the needle, decode drift.
    fa3_result = _fa3(probe, fa3_rows, schemes, layers, sig, config) if config.fa3 else None
    probed = time.perf_counter()
    needle_result = _needle(model, tokenizer, layers, schemes, config, context) if config.needle else None
    needled = time.perf_counter()
    drifts = measure_drift(model, layers, schemes + floor, prompts, config.generate, progress=config.progress) if prompts else {}
    drifted = time.perf_counter()

    # 7. Numbers; the limits, from the floor unless set; verdicts; which layers to keep unquantized; the recommendation.
    results = {s.name: scheme_result(s, tallies[s.name], probe.ref_sq, ref_nll) for s in schemes + floor}
    for name, r in results.items():
        check_measured(name, r)
    check_reference(ref_nll, results.get(FLOOR))  # NaN or Inf there: nothing can be judged against it
    floor_result = results.pop(FLOOR, None)
    limits = config.thresholds.resolve(floor_result, len(sequences) * (config.data.seq_len - 1))
    measured_kl = {n: t for n, t in tallies.items()  # the quantized schemes and the floor; a non-finite one has no verdict
                   if (n == FLOOR or n in results and results[n]["mode"] != Mode.REFERENCE) and math.isfinite(t.token_kl.sum())}
    tail_result = tails({n: t.token_kl for n, t in measured_kl.items()}, {n: t.clear_flips for n, t in measured_kl.items()},
                        seed=config.data.seed, floor=FLOOR if floor_result else None, floor_pass=limits.floor_pass)
    for name, r in [*results.items(), *([(FLOOR, floor_result)] if floor_result else [])]:
        r["tails"], r["drift"] = tail_result["schemes"].get(name), drifts.get(name)
        t = measured_kl.get(name)
        r["depth"] = depth.by_depth(t.token_kl, t.token_top1, layouts) if t is not None else None
        r["token_kinds"] = token_kinds.by_kind(t.token_kl, t.token_top1, layouts) if t is not None else None
    for name, r in results.items():
        if needle_result and r["mode"] != Mode.REFERENCE:
            r["needle_lost"] = needle_result["summary"][name]["lost"]
        r["verdict"], r["reasons"] = judge(r, limits)
        r["reasons"] += _evidence_reasons(r)
        r["servable"] = name not in held["not_servable"]
        if not r["servable"]:
            r["reasons"].append(held["not_servable"][name])
        r["kv_dtype"] = scheme_dtype(next(s for s in schemes if s.name == name))
    engine_result, engine_error = _engine(config, started, model, sig, layers, schemes, sequences, prompts, results, limits,
                                          serving.unquantized_dtype(model_config)) if started else (None, None)
    # The serving target's vLLM: a dtype it lacks or serves wrongly is marked so instead of a verdict, never chosen.
    for name, why in target_refusals(results, config.target).items():
        results[name]["target_refusal"] = why.short
        results[name]["reasons"].append(f"{why.note} ({'measured' if why.evidence == 'measured' else 'read in the source'}, "
                                        f"{serving.build_name(config.target)})")
    choice = choose(results)
    skip_probe = None
    if choice is not None and config.probe_layers and len(layers) > 1 and results[choice]["mode"] != Mode.REFERENCE:
        skip_probe = probe_skip_layers(model, layers, next(s for s in schemes if s.name == choice), results[choice], sequences, config)
    for r in results.values():
        r["bytes_per_token"] = len(layers) * DTYPES[r["kv_dtype"]].bytes_per_token(sig.num_kv_heads, sig.head_dim, _value_dim(sig))
        r["bytes_vs_bf16"] = (DTYPES[r["kv_dtype"]].bytes_per_token(1, sig.head_dim, _value_dim(sig))
                              / DTYPES["auto"].bytes_per_token(1, sig.head_dim, _value_dim(sig)))
    kv_layers = _kv_layers(model.config, layers, sig)
    pays = does_it_pay(config, kv_layers, files, results, context or config.data.seq_len)
    if skip_probe is not None:
        skip_probe["bytes_per_token"] = skip_cost(kv_layers, results[skip_probe["scheme"]]["kv_dtype"], skip_probe["skip"], pays["context"])
    plain = serving.unquantized_dtype(model_config)  # auto, unless a kv_cache_scheme would make auto fp8
    scale1 = scale1_answer(results)  # "is scale 1.0 enough?"
    vllm_version = config.vllm_version or installed_vllm_version()  # the release the caveats are said for
    served = served_model(config.checkpoint)  # the report's serve lines name no local path
    recommendation, serve = recommend(results, held, layers, checkpoint_name(config.checkpoint), skip_probe, pays,
                                      target=config.target, unquantized=plain, scale1=scale1["text"] if scale1 else None,
                                      vllm_version=vllm_version, served=served,
                                      engine_target=engine_result["target"] if engine_result else None,
                                      mla=bool(sig.latent_dim), model_type=model_config.get("model_type"))
    if started is not None:
        recommendation[:0] = [*(f"{AUDIT_FAILED}{line}" for line in started.audit.failures),
                              *([f"{NOT_DELIVERED}{started.delivery.text()}"] if started.delivery and not started.delivery.ok() else []),
                              *([f"{ENGINE_FAILED}, which alone is judged here: {engine_error}"] if engine_error else
                                [f"Ranked and judged on the engine's figures (vLLM {engine_result['vllm_version']}, "
                                 f"{engine_result['attention_backend']}, target {engine_result['target']}) where it ran a "
                                 "scheme, the emulation's beside them; docs/engine.md."])]
    per_target = serve_lines(results, held, layers, served, skip_probe, unquantized=plain)
    dtype = str(model.dtype).removeprefix("torch.")
    rep = {
        "kvcal_version": kvcal_version(),
        "caveats_for_vllm": vllm_version,  # the release the recommendation's engine caveats are said for (None: unknown)
        "checkpoint": checkpoint_name(config.checkpoint),  # no local path: the report travels with OUT's card
        "reference": {"name": REFERENCE, "dtype": dtype, "device": str(device),
                      "model": (what := reference_model(described.quant, model, dtype)),
                      "note": f"the reference is the {what} in {dtype}, called {REFERENCE} as vLLM would serve it"},
        "fp8_format": fmt.name,
        "backend": config.backend,
        "settings": portable_settings(config.settings()),
        "data": portable_manifest(manifest),
        "sample": {"sequences": len(sequences), "seq_len": config.data.seq_len, "tokens": len(sequences) * config.data.seq_len},
        "held_out": {"calibration_records": len(calibration), "excluded_records": excluded,
                     "include_calibration_data": config.include_calibration_data,
                     "calibration_known": records_path(config.checkpoint).is_file()},
        "layers": [vars(layer) for layer in layers],
        "checkpoint_scales": held,
        "floor": floor_result,
        "thresholds": {**{name: getattr(limits, name) for name in Thresholds.LIMITS}, "origin": config.thresholds.origin(),
                       "floor_pass": limits.floor_pass, "floor_fail": limits.floor_fail,
                       "relative_to_floor": floor_result is not None and floor_result["kl"] > 0},
        "schemes": results,
        "skip_layers": skip_probe,
        "does_it_pay": pays,
        "skipped": skipped,
        "fa3": fa3_result,
        "needle": needle_result,
        "recommendation": recommendation,
        "scale1": scale1,
        "target": config.target,
        "serve_command": serve,  # the line for ``target``, printed last
        "serve_lines": per_target,  # every target's line, with the vLLM build it was checked against
        "engine": engine_result,
        "engine_error": engine_error,  # the engine's failure after the emulation ran (None: it ran, or was not asked)
        "position_profile": _position_profile(stats),
        "tails": {k: v for k, v in tail_result.items() if k != "schemes"},
        "depth": {"rule": depth.rule(), "first_end": depth.FIRST_END, "growth": depth.GROWTH, "min_sequences": depth.MIN_SEQUENCES},
        "token_kinds": {"rule": token_kinds.rule(), "ratio": token_kinds.RATIO, "min_tokens": token_kinds.MIN_TOKENS},
        "drift": {"steps": config.generate, "prompts": len(prompts), "prompts_asked": config.prompts, "prompt_len": config.prompt_len,
                  "prompt_source": prompt_source, "near_tie_nats": NEAR_TIE_NATS} if prompts else None,
        "timings": {
            "sample_s": sampled - start, "load_s": loaded - sampled, "passes_s": measured - loaded,
            "reference_pass_s": ref_seconds, "scheme_pass_s": {n: t.seconds for n, t in tallies.items()},
            "skip_probe_s": skip_probe["seconds"] if skip_probe else 0.0, "fa3_s": probed - measured,
            "needle_s": needled - probed, "drift_s": drifted - needled, "total_s": time.perf_counter() - start,
        },
    }
    # 8. Report files; a kvcal output's model card gets this table.
    out = None
    if config.report_dir is not None:
        out = Path(config.report_dir)
        report.write_verify_report(out, rep)
        _refresh_card(config.checkpoint, rep)
    return VerifyResult(rep, out, config.checkpoint)


def checkpoint_name(checkpoint: str) -> str:
    """How the report names the checkpoint verified: its Hub id and revision when it is a Hub snapshot, else its
    folder's name (never a local path)."""
    origin = snapshot_origin(checkpoint)
    return f"{origin['id']}@{origin['revision']}" if origin else Path(checkpoint).resolve().name


def served_model(checkpoint: str) -> str:
    """The model the report's serve lines name: a kvcal output's card name (``card.served_name``: its --hub-id, else a
    placeholder), a Hub snapshot's repo id, else the placeholder; the terminal names the checkpoint as typed."""
    if is_kvcal_output(checkpoint):
        return served_name(read_json_object(provenance_path(checkpoint), "calibrate it again"))
    origin = snapshot_origin(checkpoint)
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


def _start_engine(config: VerifyConfig) -> EngineStart:
    """Find vLLM, set the emulation and the target to its platform (``VerifyConfig.match_engine``, said on stderr with
    the progress), read its cache dtypes, run the load audit and, where it passed on a kvcal output, the delivery check
    (``engine.delivery``: the kernel uses the scales): a vLLM that cannot load the checkpoint ends the run here, in one
    line, before the emulation's long passes."""
    host = engine.probe(config.vllm_python)
    settings = config.match_engine(host.platform, platform(host.platform))
    if config.progress:
        print(f"kvcal: {settings}", file=sys.stderr, flush=True)
    checkpoint = Path(config.checkpoint).resolve()  # vLLM runs elsewhere: a relative path would read as a Hub id there
    try:
        dtypes = engine_dtypes(host.python)
        held = audit(checkpoint, host.python)
        delivered = check_delivery(checkpoint, host.python) if held.status == OK and is_kvcal_output(checkpoint) else None
    except EngineError as e:
        raise ValueError(f"vLLM {host.version} could not start on {checkpoint.name}, so nothing can be measured in the "
                         f"engine: {e}") from None
    if held.status == FAILED and not held.layers:  # vLLM refused the load itself
        raise ValueError(f"{held.failures[0]}: nothing can be measured in the engine; fix the checkpoint (kvcal inspect "
                         f"{config.checkpoint}), or verify without --engine")
    return EngineStart(host, held, delivered, settings, dtypes)


def _engine(config: VerifyConfig, started: EngineStart, model, sig: ModelSignature, layers, schemes: list[Scheme],
            sequences: list[torch.Tensor], prompts: list[torch.Tensor], results: dict, limits: Thresholds,
            unquantized: str) -> tuple[dict | None, str | None]:
    """The same sequences in the engine, once per scheme it can serve, judged there (``engine.judge_on_engine``); with
    decode drift's prompts, the engine's own greedy decode after each too. (result, None), or (None, the failure in
    one line) when the engine failed after the emulation ran, which then stands alone."""
    import tempfile

    host = started.host
    block = config.block_size or platform(host.platform).block_size
    longest = max(config.data.seq_len + 1, max((len(p) + config.generate for p in prompts), default=0))
    max_len = config.max_model_len or engine.model_len(longest, block)
    settings = {"max_model_len": max_len, "block_size": block, "dtype": config.dtype, "chunk_len": config.data.chunk_len,
                "prefix_caching": False, "enforce_eager": True}
    names = ["auto", "auto2", *(s.name for s in schemes if s.mode != Mode.REFERENCE)]
    targets = torch.stack([s[1:] for s in sequences]).numpy()  # the next tokens, for the engine's perplexity
    try:
        with tempfile.TemporaryDirectory(prefix="kvcal-engine-") as tmp:
            ref = engine.reference_logprobs(model, sequences, Path(tmp) / "reference.npy")
            runs = engine.run_schemes(host, Path(config.checkpoint).resolve(), names, [s.tolist() for s in sequences],
                                      dtype=config.dtype or "auto", chunk_len=config.data.chunk_len, max_model_len=max_len,
                                      block_size=block, kv_bytes=engine.kv_cache_bytes(len(layers), sig.num_kv_heads,
                                                                                       sig.head_dim, max_len, block),
                                      vocab_size=ref.shape[-1], workdir=Path(tmp), unquantized=unquantized,
                                      offered=started.dtypes.names, prompts=[p.tolist() for p in prompts],
                                      steps=config.generate)
            result = engine.compare(results, runs, ref, {s.name: s.scales for s in schemes if s.scales}, host, settings,
                                    targets)
            del ref
    except (ValueError, EngineError) as e:
        return None, str(e)
    engine.judge_on_engine(results, result, limits)
    held = started.audit
    result["audit"] = {"status": held.status, "failures": held.failures, "reason": held.reason,
                       "kv_cache_dtype": held.kv_cache_dtype}
    result["set"], result["not_emulated"] = started.settings, started.dtypes.not_emulated()
    result["delivery"] = started.delivery.to_json() | {"text": started.delivery.text()} if started.delivery else None
    return result, None


def _refresh_card(checkpoint: str, rep: dict) -> None:
    """Rewrite the verify table in the card of a kvcal output, or kvcal's section in that of a pack applied to other
    weights (``card.refresh_applied``); any other card is left alone."""
    try:
        if not is_kvcal_output(checkpoint):
            refresh_applied(checkpoint, rep)
            return
        write_card(checkpoint, read_json_object(provenance_path(checkpoint), "calibrate it again"), rep)
    except OSError as e:
        warnings.warn(f"{checkpoint}/README.md keeps its old verify table: {e.strerror or e}", stacklevel=3)
