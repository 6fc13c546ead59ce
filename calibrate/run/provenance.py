"""A calibration's provenance: everything needed to reproduce and compare a run, saved as kvcal/calibration.json."""

from __future__ import annotations

import platform
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import torch

from ..capture.stats import Stats
from ..checkpoint.write import stored_scales
from ..config import LITTLE_DATA_TOKENS, CalibrationConfig
from ..fp8 import FP8Format
from ..hub import base_model
from ..layout import KVCAL_DIR, RECORDS_FILE
from ..model.layers import AttentionLayer, ModelSignature
from ..scales.at_one import at_one_report, at_scale_one
from ..scales.observers import ScaleSet, latent_report
from ..version import kvcal_version


def provenance(config: CalibrationConfig, layers: list[AttentionLayer], sig: ModelSignature, stats: Stats,
               scale_set: ScaleSet, manifest: list[dict], records: list[str], wall_s: float, device: torch.device,
               dtype: torch.dtype, ranks: int) -> dict:
    """Everything needed to reproduce and compare a run, saved as kvcal/calibration.json."""
    return {
        "kvcal_version": kvcal_version(),
        "versions": {"torch": torch.__version__, "transformers": version("transformers"), "python": platform.python_version()},
        "model": str(Path(config.model).resolve()),
        # The model card's names (verification/card.py): the base model with its revision, the repo OUT goes to.
        "base_model": base_model(config.model, config.base_model),
        "hub_id": config.hub_id,
        "signature": asdict(sig),
        "layers": [asdict(layer) for layer in layers],
        "data": manifest,
        # The records the statistics saw, by digest, in their own file: verify leaves them out of its sample.
        "records": {"file": f"{KVCAL_DIR}/{RECORDS_FILE}", "count": len(records),
                    "digest": "sha256 of the record's token ids as 8-byte little-endian integers, first 16 hex digits"},
        "settings": config.settings(),
        "recipe": config.recipe,
        "device": str(device),
        "ranks": ranks,  # processes that shared the data (torchrun), each on its own device
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": int(stats.tokens.max()),
        # Fewer tokens per layer than the threshold: the summary says so too.
        "little_data": int(stats.tokens.min()) < LITTLE_DATA_TOKENS,
        "little_data_threshold": LITTLE_DATA_TOKENS,
        "wall_time_s": round(wall_s, 2),
        "scales": scale_report(scale_set),
        # What vLLM's scale of 1.0 would clip (scales/at_one.py): the line calibrate prints, the card and inspect give.
        "at_scale_1": at_one_provenance(stats, scale_set.fmt, layers),
        # MLA: the latent and k_pe apart, and what vLLM READ_IN's k_scale of 1.0 saturates (result.CalibrationResult._latent_note).
        **({"mla": latent_report(stats.kinds, sig.latent_dim, scale_set.fmt)} if sig.latent_dim else {}),
    }


def at_one_provenance(stats: Stats, fmt: FP8Format, layers: list[AttentionLayer]) -> dict:
    """calibration.json's "at_scale_1": what scale 1.0 does to each kind, per layer (``scales/at_one.py``)."""
    return at_one_report(at_scale_one(stats, fmt), fmt, [layer.layer_idx for layer in layers])


def scale_report(scale_set: ScaleSet) -> dict:
    """Scales and their predicted cost as plain lists, for JSON."""
    return {
        "observer": scale_set.observer,
        "granularity": scale_set.granularity,
        "fp8_format": scale_set.fmt.name,
        "headroom": scale_set.headroom,
        "scales": {k: v.tolist() for k, v in scale_set.scales.items()},
        "checkpoint_scales": {k: v.tolist() for k, v in stored_scales(scale_set).items()},
        "predicted_saturated": {k: p.saturated.tolist() for k, p in scale_set.predictions.items()},
        "predicted_sink_saturated": {k: v.tolist() for k, v in scale_set.sink_saturated.items()},
        "predicted_underflow": {k: p.underflow.tolist() for k, p in scale_set.predictions.items()},
        "predicted_rel_mse": {k: p.rel_mse.tolist() for k, p in scale_set.predictions.items()},
        "per_token_rel_mse": {k: v.tolist() for k, v in scale_set.token_rel_mse.items()},
    }


STATS_SHA256 = "stats_sha256"  # calibration.json's key for the sha256 of kvcal/stats.safetensors
