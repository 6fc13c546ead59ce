"""Faults: a run SIGKILLed at each phase, then run again (issue 26, "nothing lost, nothing silent").

Each test starts the real command in a process of its own (PYTHONPATH: this checkout) with ``KVCAL_PAUSE_AT=PHASE``:
``layout.pause_at`` writes the marker file when the run reaches PHASE and holds it there, and the test kills it then.
Nothing waits on the clock: the test goes on when the marker appears (or fails when the process exits first, or
when REACH_S pass without it: a deadline against a hang, never a timing).
After the rerun, OUT is complete and nothing from the killed run is left beside it; the only thing a killed run may
leave for the rerun is its save, ``.OUT.kvcal-resume``, which ``--resume`` uses; an interrupted ``--overwrite``
leaves the old OUT intact (moved aside, and put back by the next run) or the new one, never neither.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import kjv_jsonl, save_tiny_checkpoint
from runners import SIGINT_DEFAULT

from calibrate.checkpoint.write import check_index
from calibrate.layout import is_kvcal_output, provenance_path

REPO = Path(__file__).resolve().parents[2]  # the checkout whose code the subprocesses run
REACH_S = 300  # deadline for a run to reach its pause (a tiny model: seconds, unless the machine is hung)
RUN_S = 600  # deadline for a whole tiny run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, smol_tokenizer, kjv_path):
    root = tmp_path_factory.mktemp("faults-inputs")
    save_tiny_checkpoint(root / "llama", "llama", smol_tokenizer)
    kjv_jsonl(root / "data.jsonl", 200)
    return root


def _command(inputs: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "calibrate", "calibrate", str(inputs / "llama"), "--data", str(inputs / "data.jsonl"),
            "--out", str(out), "--seq-len", "32", "--max-tokens", "256", "--quiet", "--no-verify", *extra]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def start_paused(cmd: list[str], phase: str, tmp_path: Path) -> subprocess.Popen:
    """Start ``cmd`` held at ``phase``; return once it is there (its marker written)."""
    marker = tmp_path / f"paused-at-{phase}"
    log = open(tmp_path / f"{phase}.stderr", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                            env=_env(KVCAL_PAUSE_AT=phase, KVCAL_PAUSE_MARKER=str(marker)), **SIGINT_DEFAULT)
    log.close()
    deadline = time.monotonic() + REACH_S
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"kvcal exited ({proc.returncode}) before reaching {phase}: {(tmp_path / f'{phase}.stderr').read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=RUN_S)
            pytest.fail(f"kvcal did not reach {phase} within {REACH_S} s: {(tmp_path / f'{phase}.stderr').read_text()}")
        time.sleep(0.05)
    assert int(marker.read_text()) == proc.pid
    return proc


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=RUN_S)
    assert proc.returncode == -signal.SIGKILL


def rerun(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=RUN_S)
    assert proc.returncode == 0, proc.stderr


def assert_complete(out: Path) -> None:
    assert is_kvcal_output(out)
    check_index(out)  # every tensor of every shard listed once


@pytest.mark.parametrize("phase", ["stats", "weights", "rename"])
def test_a_run_killed_while_writing_leaves_nothing_and_the_rerun_succeeds(inputs, tmp_path, phase):
    runs = tmp_path / "runs"
    runs.mkdir()
    out = runs / "out"
    cmd = _command(inputs, out)
    proc = start_paused(cmd, phase, tmp_path)
    kill(proc)
    left = sorted(os.listdir(runs))
    assert f".out.kvcal-tmp-{proc.pid}" in left  # the killed run's temporary (and, at "rename", its empty claim on OUT)
    assert set(left) <= {f".out.kvcal-tmp-{proc.pid}", "out"} and not (out.exists() and any(out.iterdir()))
    rerun(cmd)  # the same command: no --overwrite needed
    assert sorted(os.listdir(runs)) == ["out"]
    assert_complete(out)


def test_a_run_killed_in_capture_resumes_and_leaves_only_out(inputs, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    out = runs / "out"
    cmd = _command(inputs, out, "--checkpoint-every", "32")
    kill(start_paused(cmd, "capture", tmp_path))
    assert sorted(os.listdir(runs)) == [".out.kvcal-resume"]  # the save --resume uses, nothing else
    rerun([*cmd, "--resume"])
    assert sorted(os.listdir(runs)) == ["out"]  # the save has served
    assert_complete(out)


def test_an_overwrite_killed_between_its_two_renames_keeps_the_old_out(inputs, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    out = runs / "out"
    cmd = _command(inputs, out, "--overwrite")
    rerun(cmd)
    before = provenance_path(out).read_text()
    proc = start_paused([*cmd, "--seed", "7"], "swap", tmp_path)
    kill(proc)
    old = runs / f".out.kvcal-old-{proc.pid}"
    assert not out.exists() and provenance_path(old).read_text() == before  # moved aside whole, not lost
    assert_complete(old)
    rerun(cmd)  # the next run puts the old OUT back, then replaces it
    assert sorted(os.listdir(runs)) == ["out"]
    assert_complete(out)
    assert json.loads(provenance_path(out).read_text())["settings"]["seed"] != 7


_PUBLISH = """
import sys
from pathlib import Path
from calibrate.demo import publish_dir

def write(tmp):
    (tmp / "weights.bin").write_bytes(b"x" * 1000)
    (tmp / "config.json").write_text("{}")

publish_dir(Path(sys.argv[1]), write)
"""


def test_a_killed_demo_conversion_is_swept_by_the_next(tmp_path):
    """publish_dir's temporaries are named with the PID: the next conversion removes those of dead processes."""
    from calibrate.demo import publish_dir

    target = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    proc = start_paused([sys.executable, "-c", _PUBLISH, str(target)], "publish", tmp_path)
    kill(proc)
    assert sorted(os.listdir(target.parent)) == [f".SmolLM2-135M-Instruct.tmp-{proc.pid}"]
    publish_dir(target, lambda tmp: (tmp / "config.json").write_text("{}"))
    assert sorted(os.listdir(target.parent)) == ["SmolLM2-135M-Instruct"]
    assert (target / "config.json").is_file()


def test_ctrl_c_in_the_short_verify_says_out_is_written_and_complete(inputs, tmp_path):
    """The short verify runs after OUT is written: an interrupt there must not say "nothing was written"."""
    runs = tmp_path / "runs"
    runs.mkdir()
    out = runs / "out"
    cmd = [arg for arg in _command(inputs, out) if arg != "--no-verify"]
    proc = start_paused(cmd, "short-verify", tmp_path)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=RUN_S) == 130
    err = (tmp_path / "short-verify.stderr").read_text()
    last = err.strip().splitlines()[-1]
    assert last == (f"kvcal: interrupted in the short verify; {out} is written and complete: to verify it, "
                    f"run kvcal verify {out} --data {inputs / 'data.jsonl'}"), err
    assert "nothing was written" not in err and "Traceback" not in err
    assert sorted(os.listdir(runs)) == ["out"]
    assert_complete(out)
