"""How much a run writes, and whether the disk and the file-size limit allow it, known before any model loads.

An output is the source's weights (hard links cost nothing when OUT is on the source's file system; otherwise each
file is copied), the source's other files (tokenizer, templates: copied), the scales shard and ``kvcal/`` with the
statistics, whose size follows from the layer count and head sizes alone. A calibration also keeps resume saves
beside OUT while it runs (two statistics files at the moment one replaces the other). ``check_room`` compares that
with the free space of OUT's file system and with the largest file against the process's RLIMIT_FSIZE, so that a
full disk is refused in one line before the compute rather than after it; ``room_error`` turns a write that still
fails (the disk filled meanwhile) into the same line.
"""

import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..capture.stats import Stats
from ..choices import size_text
from ..files import no_room
from ..layout import KVCAL_DIR, sibling
from ..model.description import ModelDescription
from ..model.directory import INDEX_FILE, KV_SCALE_PATTERN, tensor_names
from ..model.layers import ModelSignature

# What safetensors' header and kvcal's metadata (signature, data manifest) may add to a statistics file, and what the
# index, config, provenance, records and model card add to an output: generous, so that the check errs on the safe side.
HEADER_BYTES = 1 << 20
METADATA_BYTES = 4 << 20
# A source's files that the output writes anew rather than copies (write.write_checkpoint's skip).
OWN_FILES = (INDEX_FILE, "config.json", KVCAL_DIR)

class NoRoom(ValueError):
    """No room for an output: refused by ``check_room``, or a write that failed for lack of room (``room_error``).
    A calibration that meets it after its compute keeps its statistics (``keep_statistics``)."""


def stats_bytes(signature: ModelSignature) -> int:
    """Bytes of a statistics file (``Stats.save``) for a model of this signature; no memory is allocated."""
    empty = Stats.empty(signature, "meta")
    tensors = [empty.tokens, empty.pos_tokens, *(t for s in empty.kinds.values() for t in vars(s).values())]
    return sum(t.numel() * t.element_size() for t in tensors) + HEADER_BYTES


def config_stats_bytes(described: ModelDescription) -> int:
    """Bytes of the statistics a calibration of this model saves (``stats_bytes``), from config.json alone."""
    try:
        return stats_bytes(described.signature(list(range(described.num_layers or 0))))
    except ValueError:  # config.json leaves out a field its config class defaults: the loaded model's signature decides
        return 0


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: where a directory about to be created will live."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def _device(path: Path) -> int:
    return os.stat(nearest_existing(path)).st_dev


@dataclass
class Room:
    """What one write needs: bytes per purpose (for the message), the largest single file, and where."""

    where: Path  # OUT's nearest existing directory: its file system holds everything written
    parts: dict[str, int] = field(default_factory=dict)
    largest: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def add(self, what: str, sizes: list[int]) -> None:
        if sizes:
            self.parts[what] = self.parts.get(what, 0) + sum(sizes)
            self.largest = max(self.largest, *sizes)

    def describe(self) -> str:
        return ", ".join(f"{what} {size_text(size)}" for what, size in self.parts.items() if size)


def output_room(source: Path, out: Path, weight_files: list[Path], stats: int, *, resume_saves: bool = False,
                quantized: bool = False) -> Room:
    """What writing ``out`` from the checkpoint ``source`` needs on OUT's file system.

    Args:
        source: the checkpoint the weights come from.
        out: the output directory (built beside it, then renamed: the same file system).
        weight_files: the weight files linked or copied (``write.weight_files``).
        stats: bytes of the statistics file (``stats_bytes``).
        resume_saves: a calibration saving as it goes: two statistics files beside OUT at once.
        quantized: ``--weights fp8``: FP8 weights written beside OUT first (at most half of 16-bit weights).
    """
    room = Room(nearest_existing(out.parent))
    here = _device(out.parent)
    scales_in = {p: [bool(KV_SCALE_PATTERN.search(n)) for n in tensor_names(p)] for p in weight_files}
    rewritten = [p for p, is_scale in scales_in.items() if any(is_scale) and not all(is_scale)]  # all scales: dropped
    weight_files = [p for p, is_scale in scales_in.items() if not all(is_scale)]
    copied = [p for p in weight_files if p not in rewritten and os.stat(p.resolve()).st_dev != here]
    if quantized:  # the FP8 weights are written beside OUT and linked from there: none of the source's is copied
        copied, rewritten = [], []
    room.add("weights copied (the model is on another file system)", [p.stat().st_size for p in copied])
    room.add("weights rewritten without their old KV scales", [p.stat().st_size for p in rewritten])
    others = [p.stat().st_size for p in _other_files(source)]
    room.add("tokenizer and other files", others)
    room.add("statistics", [stats])
    if resume_saves:
        room.add("resume saves", [stats, stats])
    if quantized:
        room.add("FP8 weights", [p.stat().st_size // 2 for p in weight_files])
    room.parts["metadata"] = METADATA_BYTES
    return room


def _other_files(source: Path) -> list[Path]:
    """The files ``write.copy_other_files`` copies (every top-level non-weight file and folder, not hidden, not a
    kvcal output's own)."""
    found = []
    for item in sorted(Path(source).iterdir()):
        if item.name.startswith(".") or item.name.endswith(".safetensors") or item.name in OWN_FILES:
            continue
        if item.is_dir():
            found += [Path(d) / name for d, _, files in os.walk(item, followlinks=True) for name in files]
        elif item.is_file():
            found.append(item)
    return found


def file_size_limit() -> int | None:
    """The process's RLIMIT_FSIZE in bytes (the soft limit, what a write hits), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def check_room(room: Room) -> None:
    """Refuse, in one line saying how much is needed and where, a write the disk or the file-size limit cannot take."""
    free = shutil.disk_usage(room.where).free
    if room.total > free:
        raise NoRoom(f"{room.where} has {size_text(free)} free, but this run writes {size_text(room.total)} there "
                         f"({room.describe()}); nothing was written: free space there, or choose an --out on another "
                         "file system")
    limit = file_size_limit()
    if limit is not None and room.largest > limit:
        raise NoRoom(f"the file-size limit (ulimit -f) is {size_text(limit)}, but this run writes a file of "
                         f"{size_text(room.largest)} under {room.where}; nothing was written: raise the limit "
                         "(ulimit -f unlimited) and run again")


def room_error(error: BaseException, room: Room | None, out: Path) -> str:
    """The one line for a write that failed for lack of room after all the checks: what happened, and what is needed."""
    need = f"it needs {size_text(room.total)} there ({room.describe()})" if room is not None else "free space there"
    return f"writing {out} failed: {no_room(error)} in {nearest_existing(out.parent)}; {need}; the partial output was removed"


def keep_statistics(out: Path, write: Callable[[Path], None]) -> Path | None:
    """Save a run's statistics after its output could not be written, where there is room: beside OUT
    (``.OUT.kvcal-statistics``), else in ``$TMPDIR``. ``write`` fills a new directory, which then appears whole under
    its name; returns it, or None when neither place had room (each attempt is removed)."""
    beside = sibling(out, "statistics")
    shutil.rmtree(beside, ignore_errors=True)  # an earlier failed run's: this run's statistics replace it
    for place in (beside, None):
        building = None
        try:
            building = sibling(out, "tmp") if place is not None else Path(tempfile.mkdtemp(prefix=f"kvcal-{Path(out).name}-"))
            building.mkdir(exist_ok=True)
            write(building)
            if place is None:
                return building
            os.rename(building, place)
            return place
        except Exception as e:  # no room, or no access: try the next place
            if building is not None:
                shutil.rmtree(building, ignore_errors=True)
            if not (no_room(e) or isinstance(e, OSError)):
                raise
    return None
