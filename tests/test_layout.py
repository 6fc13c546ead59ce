"""layout.py: OUT's hidden siblings, and the sweep of what killed runs left beside it."""

import os
import subprocess
import sys

import pytest

from calibrate.layout import is_kvcal_output, provenance_path, sibling, sweep


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=120)
    return int(proc.stdout)


@pytest.mark.smoke
def test_sweep_removes_dead_runs_temporaries_and_keeps_live_ones(tmp_path):
    out, dead = tmp_path / "out", dead_pid()
    for kind in ("tmp", "weights"):
        sibling(out, kind, dead).mkdir()
        sibling(out, kind, os.getppid()).mkdir()  # a live process's (pytest's parent): never touched
    sibling(out, "resume").mkdir()  # a resumable run's saves are no temporary
    sweep(out)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([sibling(out, "tmp", os.getppid()).name, sibling(out, "weights", os.getppid()).name,
                           sibling(out, "resume").name])


def test_an_overwrite_swap_killed_between_its_renames_gets_its_old_output_back(tmp_path):
    out = tmp_path / "out"
    old = sibling(out, "old", dead_pid())
    provenance_path(old).parent.mkdir(parents=True)
    provenance_path(old).write_text("{}")
    sweep(out)  # OUT was renamed aside and the new one never arrived: the old one is put back
    assert is_kvcal_output(out) and not old.exists()

    old.mkdir()  # killed after the second rename: OUT is the new output, the old one is removed
    sweep(out)
    assert is_kvcal_output(out) and not old.exists()
