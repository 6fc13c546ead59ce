"""A full disk and a file-size limit (issue 36): refused before the compute, and after it nothing computed is lost.

Every run is the real command in a process of its own (PYTHONPATH: this checkout). The full disk is a small tmpfs
mounted in a private mount namespace (``unshare -rm``) that only the command's shell sees; the file-size limit is
RLIMIT_FSIZE set in the child. Each case checks exit 2, one line and no traceback, and what is left on disk:

* before the compute (calibrate, export, apply): nothing written, and for calibrate no model loaded;
* after the compute (the tmpfs filled while the run is held in ``layout.pause_at("weights")``): the partial output
  removed, the statistics kept beside OUT (or in $TMPDIR when even they find no room there), and the printed
  ``kvcal apply`` command, run once there is room, writes the scales an uninterrupted run writes.

The same cases also run in-process with the disk's answers injected (``shutil.disk_usage``, and an OSError(ENOSPC)
from the scales shard's write): listed below as ``*_injected``; they run everywhere. They do not stand in for the
real disk: on a host without unprivileged user namespaces the tmpfs cases fail under KVCAL_REQUIRE_CLIENTS=1 with a
line that says so (``runners.host_lacks``), and skip, listed, only when run by hand.
"""

import errno
import functools
import os
import resource
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import kjv_jsonl, save_tiny_checkpoint
from runners import assert_refused, host_lacks, kvcal
from safetensors.torch import load_file

from calibrate import calibrate

REPO = Path(__file__).resolve().parents[2]  # the checkout whose code the subprocesses run
TIMEOUT_S = 300
TINY = ("--seq-len", "64", "--max-tokens", "128", "--quiet", "--no-verify")
SCALES_SHARD = "model-00002-of-00002.safetensors"  # the tiny model's one weight file, then the scales


@functools.cache
def _unshare_works() -> bool:
    """Whether this machine lets an unprivileged process mount a tmpfs in a private mount namespace."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.fixture
def small_fs() -> None:
    """The tmpfs cases need ``unshare -rm`` to mount one: an operating-system setting, not hardware."""
    if not _unshare_works():
        host_lacks("unprivileged user namespaces (unshare -rm) to mount a small tmpfs",
                   "sysctl kernel.unprivileged_userns_clone=1, or a container run with user namespaces allowed")


def _kvcal() -> str:
    return shlex.join([sys.executable, "-m", "calibrate"])


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **extra}


@pytest.fixture(scope="module")
def root(tmp_path_factory, smol_tokenizer, kjv_path):
    """A tiny model (24 MiB of weights, 3.4 MiB of tokenizer) and its data, on the test's disk; an uninterrupted
    calibration of it, the scales every finished run must match."""
    root = tmp_path_factory.mktemp("no-room")
    save_tiny_checkpoint(root / "llama", "llama", smol_tokenizer)
    kjv_jsonl(root / "data.jsonl", 200)
    calibrate(str(root / "llama"), [str(root / "data.jsonl")], str(root / "out"), seq_len=64, max_tokens=128,
              progress=False, verify=False)
    return root


def _in_small_fs(root: Path, tmp_path: Path, size: str, body: str, **env: str) -> subprocess.CompletedProcess:
    """Run the shell ``body`` with a tmpfs of ``size`` at $MNT (tmp_path/mnt), seen by this shell alone; it ends by
    listing what is left in $MNT, recursively, into tmp_path/left.txt."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (f"set -u; mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mnt))} || exit 99\n"
              f"MNT={shlex.quote(str(mnt))}; KVCAL={shlex.quote(_kvcal())}; ROOT={shlex.quote(str(root))}\n"
              f"{body}\nrc=$?\n(cd \"$MNT\" && find . -mindepth 1 | sort) > {shlex.quote(str(tmp_path / 'left.txt'))}\n"
              "exit $rc\n")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=root, capture_output=True, text=True,
                            timeout=TIMEOUT_S, env=_env(**env))
    assert result.returncode != 99, result.stderr
    return result


def _error_line(result: subprocess.CompletedProcess) -> str:
    """The one ``kvcal: error:`` line, after asserting exit 2, nothing else on stderr and no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    assert len(lines) == 1 and lines[0].startswith("kvcal: error: "), result.stderr[-4000:]
    return lines[0]


# --- Before the compute -------------------------------------------------------------------------------------------

PREFLIGHT = {
    # The model lives on another file system, so its 24 MiB of weights would be copied into a 20 MiB tmpfs.
    "calibrate": '$KVCAL calibrate "$ROOT/llama" --data "$ROOT/data.jsonl" --out "$MNT/new" ' + " ".join(TINY),
    "export": '$KVCAL export "$ROOT/out" --out "$MNT/new"',
    "apply": '$KVCAL apply "$ROOT/out" "$ROOT/llama" --out "$MNT/new"',
}


@pytest.mark.usefixtures("small_fs")
@pytest.mark.parametrize("command", list(PREFLIGHT))
def test_a_disk_too_small_is_refused_before_anything_is_loaded_or_written(root, tmp_path, command):
    result = _in_small_fs(root, tmp_path, "20m", PREFLIGHT[command])
    line = _error_line(result)
    for fragment in (f"{tmp_path / 'mnt'} has 20.0 MiB free, but this run writes", "weights copied (the model is on "
                     "another file system) 24.4 MiB", "nothing was written"):
        assert fragment in line, (fragment, line)
    assert "Loading weights" not in result.stderr  # calibrate: refused before the model loads
    assert (tmp_path / "left.txt").read_text() == ""


@pytest.mark.usefixtures("small_fs")
def test_a_disk_with_room_is_not_refused(root, tmp_path):
    """The estimate is no wild guess: the same export onto a tmpfs that holds it succeeds (it needs ~34 MiB)."""
    result = _in_small_fs(root, tmp_path, "40m", PREFLIGHT["export"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "./new/kvcal/stats.safetensors" in (tmp_path / "left.txt").read_text().splitlines()


def _fsize(limit: int):
    """preexec_fn: the child's RLIMIT_FSIZE (soft and hard) set to ``limit`` bytes."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("command", ["calibrate", "export"])
def test_a_file_size_limit_below_the_largest_file_is_refused_first(root, tmp_path, command):
    """OUT on the model's file system: the weights are hard-linked, and the largest file written is the 3.4 MiB
    tokenizer copy; under ulimit -f of 2 MiB it would fail with EFBIG, so it is refused before anything is written."""
    argv = {"calibrate": ["calibrate", str(root / "llama"), "--data", str(root / "data.jsonl"), *TINY],
            "export": ["export", str(root / "out")]}[command]
    out = tmp_path / "new"
    result = subprocess.run([sys.executable, "-m", "calibrate", *argv, "--out", str(out)], capture_output=True, text=True,
                            timeout=TIMEOUT_S, env=_env(), preexec_fn=_fsize(2 << 20))
    line = _error_line(result)
    assert "the file-size limit (ulimit -f) is 2.0 MiB, but this run writes a file of 3.4 MiB" in line, line
    assert "Loading weights" not in result.stderr
    assert os.listdir(tmp_path) == [], "something was written"


# --- After the compute --------------------------------------------------------------------------------------------

def _fill_while_held(model: str) -> str:
    """Shell: calibrate ``model`` into $MNT/new, held after linking or copying its weights while this shell fills the
    tmpfs; then, with the filler removed, run the command the error printed ($KVCAL for its ``kvcal``)."""
    held = "KVCAL_PAUSE_AT=weights KVCAL_PAUSE_MARKER=\"$MNT.marker\" KVCAL_PAUSE_S=5"
    return f"""
{held} $KVCAL calibrate {model} --data "$ROOT/data.jsonl" --out "$MNT/new" {" ".join(TINY)} 2>"$MNT.err" &
pid=$!
while [ ! -f "$MNT.marker" ]; do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
dd if=/dev/zero of="$MNT/filler" bs=1M 2>/dev/null
wait $pid; rc=$?
cat "$MNT.err" >&2
(cd "$MNT" && find . -mindepth 1 | sort) > "$MNT.after-failure"
rm -f "$MNT/filler"
finish=$(sed -n 's/.*finish with: kvcal //p' "$MNT.err")
[ -n "$finish" ] && $KVCAL $finish > "$MNT.finish" 2>&1 && cp "$MNT/new/{SCALES_SHARD}" "$MNT.scales"
(exit $rc)
"""


def _check_finished(root: Path, tmp_path: Path, line: str, kept: str) -> None:
    """The run's statistics were kept at ``kept`` and the printed command wrote the scales of an uninterrupted run."""
    assert "no space left on the device" in line and "the partial output was removed" in line, line
    assert f"the statistics are saved in {kept}" in line, line
    finished = tmp_path / "mnt.scales"
    assert finished.is_file(), (tmp_path / "mnt.finish").read_text()[-4000:]
    expected, got = load_file(root / "out" / SCALES_SHARD), load_file(finished)
    assert got.keys() == expected.keys() and all((got[n] == expected[n]).all() for n in expected)


@pytest.mark.usefixtures("small_fs")
def test_a_disk_that_fills_after_the_compute_keeps_the_statistics_beside_out(root, tmp_path):
    """The model on another file system: the weights copy is removed with the partial output, which leaves room
    beside OUT for the statistics."""
    result = _in_small_fs(root, tmp_path, "48m", _fill_while_held('"$ROOT/llama"'))
    line = _error_line(result)
    mnt = tmp_path / "mnt"
    _check_finished(root, tmp_path, line, f"{mnt}/.new.kvcal-statistics")
    assert "it needs 33.9 MiB there" in line, line
    # Left after the failure: the filler and the kept statistics; no temporary output, no resume saves.
    left = (tmp_path / "mnt.after-failure").read_text().split()
    assert {p.split("/")[1] for p in left} == {"filler", ".new.kvcal-statistics"}, left
    assert "./.new.kvcal-statistics/kvcal/stats.safetensors" in left


@pytest.mark.usefixtures("small_fs")
def test_a_disk_that_fills_after_the_compute_keeps_the_statistics_in_tmpdir(root, tmp_path):
    """The model on the tmpfs itself: its weights are hard-linked, so removing the partial output frees nothing and
    the statistics go to $TMPDIR."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    result = _in_small_fs(root, tmp_path, "48m", 'cp -r "$ROOT/llama" "$MNT/llama"\n' + _fill_while_held('"$MNT/llama"'),
                          TMPDIR=str(tmpdir))
    line = _error_line(result)
    kept = [p for p in tmpdir.iterdir() if p.name.startswith("kvcal-new-")]
    assert len(kept) == 1, list(tmpdir.iterdir())
    _check_finished(root, tmp_path, line, str(kept[0]))
    assert sorted((tmp_path / "mnt.after-failure").read_text().split()) == ["./filler", "./llama", *sorted(
        f"./llama/{p.name}" for p in (root / "llama").iterdir())]


# --- The same paths with the disk faked: these run everywhere, unshare or not ---------------------------------------

def test_a_disk_too_small_is_refused_injected(root, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("shutil.disk_usage", lambda path: shutil._ntuple_diskusage(20 << 20, 20 << 20, 0))
    code, err = kvcal(capsys, "export", str(root / "out"), "--out", str(tmp_path / "new"))
    assert_refused(code, err, "has 0 B free, but this run writes", "nothing was written")
    assert os.listdir(tmp_path) == []


def test_a_disk_that_fills_after_the_compute_keeps_the_statistics_injected(root, tmp_path, capsys, monkeypatch):
    import calibrate.checkpoint.write as write

    real = write.save_tensors

    def full(tensors, path, metadata=None):
        if Path(path).name == SCALES_SHARD:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(tensors, path, metadata)

    monkeypatch.setattr(write, "save_tensors", full)
    out = tmp_path / "new"
    code, err = kvcal(capsys, "calibrate", str(root / "llama"), "--data", str(root / "data.jsonl"), "--out", str(out), *TINY)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and f"the statistics are saved in {tmp_path}/.new.kvcal-statistics" in line
    assert os.listdir(tmp_path) == [".new.kvcal-statistics"]
    monkeypatch.setattr(write, "save_tensors", real)
    assert kvcal(capsys, *shlex.split(line.split("finish with: kvcal ")[1]))[0] == 0
    expected, got = load_file(root / "out" / SCALES_SHARD), load_file(out / SCALES_SHARD)
    assert all((got[n] == expected[n]).all() for n in expected)

