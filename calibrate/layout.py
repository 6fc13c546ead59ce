"""The layout of a kvcal output directory (OUT) and of the hidden siblings a run keeps beside it.

    OUT/                          a checkpoint vLLM and transformers load (checkpoint/write.py builds it)
      kvcal/calibration.json      provenance: settings, data manifest, scales; its presence marks a kvcal output
      kvcal/stats.safetensors     the mergeable statistics (capture/stats.py), for export, apply and verify
      kvcal/records.txt           the calibration's records, one digest a line (data/stream.py record_digest): verify
                                  leaves them out of its sample
      kvcal/verify/               the short verify's report
    .OUT.kvcal-tmp-PID/           OUT being built by process PID, renamed into place when complete
    .OUT.kvcal-weights-PID/       quantized weights being built (--weights fp8)
    .OUT.kvcal-old-PID/           the previous OUT, moved aside during an --overwrite swap
    .OUT.kvcal-resume/            periodic saves of a long run (run/resume.py), removed once OUT is written

Siblings named with a PID belong to that process while it lives; ``sweep`` removes those of dead processes.
"""

import os
import shutil
from pathlib import Path

KVCAL_DIR = "kvcal"
PROVENANCE_FILE = "calibration.json"
STATS_FILE = "stats.safetensors"
RECORDS_FILE = "records.txt"
VERIFY_DIR = "verify"
TEMPORARIES = ("tmp", "weights", "old")  # siblings named with their writer's PID


def provenance_path(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / PROVENANCE_FILE


def stats_path(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / STATS_FILE


def records_path(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / RECORDS_FILE


def verify_dir(out: str | Path) -> Path:
    return Path(out) / KVCAL_DIR / VERIFY_DIR


def is_kvcal_output(directory: str | Path) -> bool:
    """Whether ``directory`` is an output kvcal wrote: only those may ``--overwrite`` replace."""
    return provenance_path(directory).is_file()


def sibling(out: str | Path, kind: str, pid: int | None = None) -> Path:
    """The hidden directory of ``kind`` (TEMPORARIES, or "resume") beside OUT; temporaries are this process's."""
    out = Path(out)
    if kind == "resume":
        return out.parent / f".{out.name}.kvcal-resume"
    return out.parent / f".{out.name}.kvcal-{kind}-{os.getpid() if pid is None else pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep(out: str | Path) -> None:
    """Clear what killed runs (SIGKILL, power loss) left beside OUT, keeping what live runs own.

    A previous OUT left aside by a swap that died between its two renames is put back when OUT is missing, so an
    interrupted ``--overwrite`` leaves the old output or the new one, never neither.
    """
    out = Path(out)
    for kind in TEMPORARIES:
        for path in sorted(out.parent.glob(f".{out.name}.kvcal-{kind}-*")):
            pid = path.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            if kind == "old" and not out.exists():
                os.rename(path, out)
            else:
                shutil.rmtree(path, ignore_errors=True)
