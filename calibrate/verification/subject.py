"""verify's first step: the checkpoint described once, before anything is loaded.

config.json's facts, the weight files vLLM loads (every header checked), the scales vLLM would refuse or that lie about
the checkpoint's statistics (refused as ``kvcal inspect`` fails them), whether kvcal wrote it, and which calibration
records the held-out sample must leave out. Every later step takes the ``Subject`` instead of reading the folder again.
"""

from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.scale_check import checkpoint_findings, refuse
from ..checkpoint.write import weight_files
from ..data.stream import read_digests
from ..files import read_json_object
from ..hub import snapshot_origin
from ..layout import is_kvcal_output, provenance_path, records_path
from ..model.description import ModelDescription, check_known_type, describe
from ..model.directory import prefixes_in
from .card import PLACEHOLDER, served_name
from .config import VerifyConfig


@dataclass(frozen=True)
class Subject:
    """The checkpoint verify measures, described once: config.json's facts, the weight files vLLM loads (headers
    checked), whether kvcal wrote it, and the calibration records its sample leaves out."""

    path: str  # as the user typed it
    described: ModelDescription
    files: list[Path]
    prefixes: dict[int, str]  # layer index → attention prefix in those files (``directory.prefixes_in``)
    absolute: Path  # resolved: vLLM runs elsewhere, where a relative path would read as a Hub id
    kvcal_output: bool
    calibration: frozenset[str]  # digests of the records calibration used (empty: none known, or opted in)
    calibration_records: int  # how many it used, for the report (counted even when opted in)
    calibration_known: bool  # the checkpoint says which records calibration used


def describe_subject(config: VerifyConfig) -> Subject:
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
