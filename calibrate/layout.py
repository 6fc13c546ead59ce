"""The layout of a kvcal output directory (OUT) and of the hidden siblings a run keeps beside it.

    OUT/                          a checkpoint vLLM and transformers load (checkpoint/write.py builds it)
      README.md                   the model card (verification/card.py): kvcal's section, then the source's card
      kvcal/calibration.json      provenance: settings, data manifest, scales; its presence marks a kvcal output
      kvcal/stats.safetensors     the mergeable statistics (capture/stats.py), for export, apply and verify
      kvcal/records.txt           the calibration's records, one digest a line (data/stream.py record_digest): verify
                                  leaves them out of its sample
      kvcal/verify/               the short verify's report
    .OUT.kvcal-tmp-PID/           OUT being built by process PID, renamed into place when complete
    .OUT.kvcal-weights-PID/       quantized weights being built (--weights fp8)
    .OUT.kvcal-old-PID/           the previous OUT, moved aside during an --overwrite swap
    .OUT.kvcal-resume/            periodic saves of a long run (run/resume.py), removed once OUT is written
    .OUT.kvcal-statistics/        a run's statistics, kept when OUT could not be written for lack of room
                                  (checkpoint/space.py); ``kvcal apply`` writes OUT from it

    PACK/                         the scales alone, pinned to their base model's weights (checkpoint/pack.py,
                                  ``kvcal export --pack``); ``kvcal apply PACK MODEL`` writes a servable OUT from it
      README.md                   OUT's model card
      manifest.json               base model id and revision, sha256 of each weight file, the scales' form and layers
      kv_scales.safetensors       OUT's scales shard, byte for byte
      config_fragment.json        config file name → the keys vLLM needs set in it
      kvcal/records.txt           the calibration's record digests, as in OUT
    OUT/kvcal/manifest.json       in an OUT applied from a pack: that pack's manifest
    OUT/README.md                 applied from a pack to other weights (--other-weights): the target's own card, with
                                  kvcal's section between SECTION_BEGIN and SECTION_END

Siblings named with a PID belong to that process while it lives; ``sweep`` removes those of dead processes.

Test-only: ``pause_at`` holds a run at a named phase so that tests/e2e/test_faults.py can kill it there.
"""

import os
import shutil
import time
from pathlib import Path

KVCAL_DIR = "kvcal"
PROVENANCE_FILE = "calibration.json"
STATS_FILE = "stats.safetensors"
RECORDS_FILE = "records.txt"
VERIFY_DIR = "verify"
CARD_FILE = "README.md"  # where the Hugging Face Hub looks for a model card
# Ends kvcal's section in every card kvcal writes, the source's card or nothing after it: a refresh keeps what follows.
CARD_MARKER = "<!-- kvcal's section ends here; what follows is the source model's own card, unchanged -->"
# Around kvcal's section in a card kvcal did not write (a pack applied to other weights): the card's own front matter and
# text stay outside them, untouched; a refresh rewrites what lies between them.
SECTION_BEGIN = "<!-- kvcal's section begins: kvcal rewrites what lies between these markers, and nothing else -->"
SECTION_END = "<!-- kvcal's section ends -->"
PACK_MANIFEST = "manifest.json"
PACK_SCALES = "kv_scales.safetensors"
PACK_FRAGMENT = "config_fragment.json"
TEMPORARIES = ("tmp", "weights", "old")  # siblings named with their writer's PID


def provenance_path(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / PROVENANCE_FILE


def card_path(out: str | Path) -> Path:
    return Path(out) / CARD_FILE


def stats_path(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / STATS_FILE


def records_path(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / RECORDS_FILE


# Every file a verify report folder holds (verification/report.py writes them; the plots only where their data exist).
VERIFY_REPORT_FILES = ("report.json", "report.md", "layer_error.png", "scales.png", "kl_by_depth.png",
                       "position_profile.png")


def verify_dir(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / VERIFY_DIR


def is_kvcal_output(directory: str | Path) -> bool:
    """Whether ``directory`` is an output kvcal wrote: only those may ``--overwrite`` replace."""
    return provenance_path(directory).is_file()


def is_pack(directory: str | Path) -> bool:
    """Whether ``directory`` is a pack ``kvcal export --pack`` wrote."""
    return (Path(directory) / PACK_MANIFEST).is_file() and (Path(directory) / PACK_SCALES).is_file()


def pack_files_missing(directory: str | Path) -> list[str] | None:
    """The files a pack needs (its manifest and scales shard) that ``directory`` lacks, when it holds a file only a pack
    has (the scales shard or the config fragment): ``[]`` for a whole pack, None for a folder that is no pack at all."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in (PACK_SCALES, PACK_FRAGMENT)):
        return None
    return [name for name in (PACK_MANIFEST, PACK_SCALES) if not (directory / name).is_file()]


def replaceable(directory: str | Path) -> bool:
    """Whether ``--overwrite`` may replace ``directory``: only what kvcal wrote (an output, one applied from a pack, a
    pack)."""
    return is_kvcal_output(directory) or (Path(directory) / KVCAL_DIR / PACK_MANIFEST).is_file() or is_pack(directory)


def sibling(out: str | Path, kind: str, pid: int | None = None) -> Path:
    """The hidden directory of ``kind`` (TEMPORARIES, "resume" or "statistics") beside OUT; temporaries are this
    process's."""
    out = Path(out)
    if kind in ("resume", "statistics"):
        return out.parent / f".{out.name}.kvcal-{kind}"
    return out.parent / f".{out.name}.kvcal-{kind}-{os.getpid() if pid is None else pid}"


def identity(path: str | Path) -> tuple[int, int] | None:
    """(st_ino, st_mtime_ns) of ``path`` as it is now, None when it does not exist: which OUT a run started with."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def dead_temporaries(parent: Path, prefix: str) -> list[Path]:
    """Entries of ``parent`` named ``PREFIX<pid>`` whose process is dead (never this one's)."""
    found = []
    for path in sorted(Path(parent).glob(f"{prefix}*")):
        pid = path.name[len(prefix):]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            found.append(path)
    return found


def sweep(out: str | Path) -> None:
    """Clear what killed runs (SIGKILL, power loss) left beside OUT, keeping what live runs own.

    A previous OUT left aside by a swap that died between its two renames is put back when OUT is missing, so an
    interrupted ``--overwrite`` leaves the old output or the new one, never neither. An empty OUT beside a dead run's
    complete temporary is that run's claim on the name (made just before its final rename): it is removed with it.
    """
    out = Path(out)
    for kind in TEMPORARIES:
        for path in dead_temporaries(out.parent, f".{out.name}.kvcal-{kind}-"):
            if kind == "old" and not out.exists():
                os.rename(path, out)
                continue
            if kind == "tmp" and out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
                out.rmdir()
            shutil.rmtree(path, ignore_errors=True)


def swap_in(new: Path, out: Path) -> None:
    """Replace the directory ``out`` by ``new`` in two renames: ``out`` aside (``sibling(out, "old")``), then ``new`` in
    its place; the old one is removed only after, and put back where the second rename fails. Between the renames
    ``out`` is missing, never half-written (``sweep`` puts back one a killed run left aside)."""
    old = sibling(out, "old")
    os.rename(out, old)
    pause_at("swap")  # test-only: between the swap's two renames, OUT missing
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# Test-only (tests/e2e/test_faults.py): the phases a run can be held at, named where pause_at is called.
PAUSE_PHASES = ("capture", "stats", "weights", "rename", "swap", "publish", "short-verify")


def pause_at(phase: str) -> None:
    """Test-only: hold this process at ``phase`` when ``$KVCAL_PAUSE_AT`` names it, so a test can kill it there.

    Writes this process's PID to the file ``$KVCAL_PAUSE_MARKER`` (when set), then sleeps ``$KVCAL_PAUSE_S`` seconds
    (default 3600) and carries on. Without ``$KVCAL_PAUSE_AT`` it does nothing; no user should set it.
    """
    if os.environ.get("KVCAL_PAUSE_AT") != phase:
        return
    marker = os.environ.get("KVCAL_PAUSE_MARKER")
    if marker:
        Path(marker).with_name(Path(marker).name + ".tmp").write_text(str(os.getpid()))
        os.replace(Path(marker).with_name(Path(marker).name + ".tmp"), marker)  # the marker appears whole
    time.sleep(float(os.environ.get("KVCAL_PAUSE_S", "3600")))
