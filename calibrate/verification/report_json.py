"""verify's report.json: every number of the run, no local path; and the model card's verify table refreshed."""

import warnings
from pathlib import Path

from ..capture.stats import Stats, position_bucket_starts
from ..data.stream import portable_manifest
from ..files import read_json_object
from ..fp8 import get_format
from ..layout import provenance_path
from ..version import kvcal_version
from . import depth, token_kinds
from .advice import Advice
from .card import refresh_applied, write_card
from .config import NEAR_TIE_NATS, REFERENCE, VerifyConfig
from .emulation import Emulated
from .judgment import Judged, thresholds_json
from .reference import Reference, reference_model
from .sample import Sample
from .subject import Subject, checkpoint_name


def build_report(config: VerifyConfig, subject: Subject, ref: Reference, sample: Sample, emulated: Emulated,
                 judged: Judged, advice: Advice, engine_result: dict | None, engine_error: str | None,
                 timings: dict) -> dict:
    """report.json's content: every number of the run, no local path."""
    model, config_data, prompts = ref.model, config.data, sample.prompts
    dtype = str(model.dtype).removeprefix("torch.")
    floor_result = judged.floor
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
        "thresholds": thresholds_json(config.thresholds, judged.limits, floor_result),
        "schemes": advice.results,
        "skip_layers": advice.skip_probe,
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
        "position_profile": position_profile(ref.stats),
        "tails": {k: v for k, v in judged.tails.items() if k != "schemes"},
        "depth": {"rule": depth.rule(), "first_end": depth.FIRST_END, "growth": depth.GROWTH, "min_sequences": depth.MIN_SEQUENCES},
        "token_kinds": {"rule": token_kinds.rule(), "ratio": token_kinds.RATIO, "min_tokens": token_kinds.MIN_TOKENS},
        "drift": {"steps": config.generate, "prompts": len(prompts), "prompts_asked": config.prompts, "prompt_len": config.prompt_len,
                  "prompt_source": sample.prompt_source, "near_tie_nats": NEAR_TIE_NATS} if prompts else None,
        "timings": timings,
    }


def position_profile(stats: Stats | None) -> dict | None:
    """Absmax by position bucket (max over heads) from the statistics, for the report's position plot."""
    if stats is None:
        return None
    return {
        "bucket_starts": position_bucket_starts(),
        "tokens": stats.pos_tokens.tolist(),  # [L, P]
        **{kind: stats.kinds[kind].pos_absmax.amax(1).tolist() for kind in ("k", "v", "q")},  # [L, P]
    }


def portable_settings(settings: dict) -> dict:
    """Verify's settings without local paths: scales files and the report folder by name."""
    schemes = [Path(s).name if s.endswith(".safetensors") else s for s in settings["schemes"]]
    return {**settings, "schemes": schemes, "report_dir": settings["report_dir"] and Path(settings["report_dir"]).name}


def refresh_card(subject: Subject, rep: dict) -> None:
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
