"""OUT's ``kvcal/`` folder: the statistics, the provenance and the calibration's record digests, written and read back.

Export and apply start from it; verify leaves the listed records out of its sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..capture.stats import Stats
from ..files import file_sha256, read_json_object
from ..layout import (
    KVCAL_DIR,
    PROVENANCE_FILE,
    RECORDS_FILE,
    STATS_FILE,
    is_pack,
    pause_at,
    provenance_path,
    records_path,
    stats_path,
)
from .pack import incomplete_pack

STATS_SHA256 = "stats_sha256"  # calibration.json's key for the sha256 of kvcal/stats.safetensors


def write_kvcal_dir(directory: Path, stats: Stats, provenance: dict, records: list[str] | None) -> None:
    """Statistics, provenance (given the statistics' digest) and the record digests (None: none known) into
    ``directory``, OUT's KVCAL_DIR being built."""
    stats.save(directory / STATS_FILE)
    pause_at("stats")  # test-only (layout.pause_at)
    # The statistics' digest, so that export and apply refuse a file changed since (load_calibration).
    provenance[STATS_SHA256] = file_sha256(directory / STATS_FILE)
    (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    if records is not None:
        (directory / RECORDS_FILE).write_text("".join(d + "\n" for d in records))


def records_of(source: str | Path) -> list[str] | None:
    """The record digests a kvcal output keeps (None when it predates them): export and apply carry them on."""
    path = records_path(source)
    return path.read_text().split() if path.is_file() else None


def load_calibration(source: str | Path) -> tuple[Stats, dict]:
    """Statistics and provenance saved in a kvcal output directory."""
    stats_file, provenance_file = stats_path(source), provenance_path(source)
    if not stats_file.is_file():
        if (why := incomplete_pack(source)) is not None:
            raise ValueError(why)
        if is_pack(source):
            raise ValueError(f"{source} is a scale pack, not a calibration output: it holds the scales alone, without "
                             f"statistics; write a checkpoint from it with kvcal apply {source} MODEL --out OUT")
        raise ValueError(f"{source} has no {KVCAL_DIR}/{STATS_FILE}; pass a directory written by kvcal calibrate")
    if not provenance_file.is_file():
        raise ValueError(f"{source} has no {KVCAL_DIR}/{PROVENANCE_FILE} beside its statistics; pass a complete kvcal output")
    provenance = read_json_object(provenance_file, "it was not written by kvcal, or was damaged")
    if not isinstance(provenance.get("layers"), list):
        raise ValueError(f"{provenance_file} holds no 'layers' list; it was not written by kvcal, or was damaged")
    try:
        stats = Stats.load(stats_file)
    except SafetensorError as e:
        raise ValueError(f"{stats_file} is not a readable safetensors file ({e}); it is damaged: calibrate again") from None
    # Outputs of kvcal before the digest was recorded have none: they are read as before.
    if STATS_SHA256 in provenance and file_sha256(stats_file) != provenance[STATS_SHA256]:
        raise ValueError(f"{stats_file} is not the file this calibration wrote (its sha256 differs from the one in "
                         f"{PROVENANCE_FILE}): it was changed or damaged since; calibrate again")
    return stats, provenance


def recorded_scales_of(provenance: dict, source: str | Path) -> dict[str, torch.Tensor]:
    """The scales a calibration wrote (``ScaleSet.scales``: its format's own units), from its provenance."""
    try:
        return {kind: torch.tensor(values, dtype=torch.float32) for kind, values in provenance["scales"]["scales"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}/{KVCAL_DIR}/{PROVENANCE_FILE} holds no readable scales ({e!r}); it was damaged") from None
