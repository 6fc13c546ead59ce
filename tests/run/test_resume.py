"""Resume after a kill: periodic saves, a SIGKILLed run continued with --resume to exactly the uninterrupted result,
and resumes that would not be exact (other settings, data, ranks; no save) refused with one line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from builders import kjv_jsonl
from runners import SIGINT_DEFAULT, TORCHRUN, free_port

from calibrate import CalibrationConfig, calibrate
from calibrate.api import load_calibration
from calibrate.capture.stats import Stats
from calibrate.cli import main
from calibrate.layout import sweep
from calibrate.run.resume import STATS_SETTINGS, resume_dir

BASE = {"seq_len": 64, "max_tokens": 100_000, "progress": False, "verify": False}


def assert_same_stats(got: Stats, want: Stats) -> None:
    """Every statistic bit for bit: the resumed run adds the same numbers to the same restored sums."""
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pos_tokens, want.pos_tokens)
    for kind, s in got.kinds.items():
        for f in fields(s):
            assert torch.equal(getattr(s, f.name), getattr(want.kinds[kind], f.name)), f"{kind}.{f.name}"


def interrupted(tiny_dir, text_file, out, **options) -> dict:
    """A run that fails after its capture (min_tokens above what the ~6K-token data give) and keeps its saves,
    as a killed one would; returns its save."""
    settings = BASE | {"min_tokens": 100_000, "checkpoint_every": 1000} | options
    with pytest.raises(ValueError, match="fewer than the 100000 needed"):
        calibrate(str(tiny_dir), [str(text_file)], str(out), **settings)
    return json.loads((resume_dir(out) / "state-rank0.json").read_text())


@pytest.mark.smoke
def test_a_resumed_run_equals_an_uninterrupted_one(tiny_dir, text_file, tmp_path):
    saved = interrupted(tiny_dir, text_file, tmp_path / "out")
    assert saved["world"] == 1 and saved["sequences"] > 0 and saved["tokens"] == 64 * saved["sequences"]
    assert not (tmp_path / "out").exists()
    sweep(tmp_path / "out")  # as every write does: the save is no stale temporary
    assert (resume_dir(tmp_path / "out") / saved["stats"]).is_file()

    resumed = calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "out"), **BASE, min_tokens=64, resume=True)
    whole = calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "whole"), **BASE, min_tokens=64, checkpoint_every=0)
    assert saved["tokens"] < int(whole.stats.tokens.max())  # the resumed run did capture the rest
    assert_same_stats(resumed.stats, whole.stats)
    assert resumed.provenance["scales"] == whole.provenance["scales"]
    assert resumed.provenance["data"] == whole.provenance["data"]  # the manifest counts the skipped sequences too
    assert not resume_dir(tmp_path / "out").exists()  # removed once OUT was written


# One change per setting in resume.STATS_SETTINGS but data (its own test below), and what the refusal names.
SETTING_CHANGES = {
    "seq_len": ({"seq_len": 32}, "seq_len is 32 now but was 64 in the saved run"),
    "max_tokens": ({"max_tokens": 50_000}, "max_tokens is 50000 now but was 100000 in the saved run"),
    "chunk_len": ({"chunk_len": 32}, "chunk_len is 32 now but was 2048 in the saved run"),
    "text_field": ({"text_field": "text"}, "text_field is 'text' now but was None in the saved run"),
    "pack": ({"pack": False}, "pack is False now but was True in the saved run"),
    "seed": ({"seed": 1}, "seed is 1 now but was 0 in the saved run"),
    "long_records": ({"long_records": "error"}, "long_records is 'error' now but was 'split' in the saved run"),
    "dtype": ({"dtype": "bfloat16"}, "dtype is 'bfloat16' now but was None in the saved run"),
}


def test_the_matrix_covers_every_setting_and_the_docs_name_each():
    """Every setting resume compares has a refusal case here, and the docs' list of them is that list."""
    assert set(SETTING_CHANGES) | {"data"} == set(STATS_SETTINGS)
    repo = Path(__file__).resolve().parents[2]
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    text = next(" ".join(p.read_text().split()) for p in pages if "A resume is refused" in p.read_text())
    listed = text[text.index("A resume is refused"):].split(")", 1)[0]
    flags = set(re.findall(r"`(--[a-z-]+)`", listed))
    assert flags == {"--no-pack" if s == "pack" else "--" + s.replace("_", "-") for s in STATS_SETTINGS}, listed


@pytest.mark.parametrize("setting", SETTING_CHANGES)
def test_a_resume_with_other_settings_is_refused(tiny_dir, text_file, tmp_path, setting):
    change, message = SETTING_CHANGES[setting]
    interrupted(tiny_dir, text_file, tmp_path / "out")
    with pytest.raises(ValueError, match="cannot resume from .*kvcal-resume: ") as e:
        calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "out"), **(BASE | change), resume=True)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert resume_dir(tmp_path / "out").is_dir()  # a refused resume keeps the save


@pytest.mark.parametrize("change, message", [
    (lambda model: (model / "config.json").write_text((model / "config.json").read_text().replace("{", '{"x": 1, ', 1)),
     "model file config.json differs from the saved run's"),
    (lambda model: (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + "\n"),
     "model file tokenizer_config.json differs from the saved run's"),
], ids=["config", "tokenizer"])
def test_a_resume_after_the_config_or_tokenizer_changed_is_refused(tiny_dir, text_file, tmp_path, change, message):
    interrupted(tiny_dir, text_file, tmp_path / "out")
    change(tiny_dir)
    with pytest.raises(ValueError, match=re.escape(message)):
        calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "out"), **BASE, resume=True)


@pytest.mark.parametrize("edit, message", [
    (lambda state: state | {"device": "cuda"}, "device is 'cpu' now but was 'cuda' in the saved run"),
    (lambda state: state | {"data": [state["data"][0] | {"revision": "0123abc"}]}, "differs from the saved run's (its contents, size or revision changed)"),
], ids=["device-type", "hub-revision"])
def test_a_resume_on_another_device_type_or_data_revision_is_refused(tiny_dir, text_file, tmp_path, edit, message):
    """The save as another machine (device type) or another revision of a hub dataset would have written it."""
    out = tmp_path / "out"
    interrupted(tiny_dir, text_file, out)
    state = resume_dir(out) / "state-rank0.json"
    state.write_text(json.dumps(edit(json.loads(state.read_text()))))
    with pytest.raises(ValueError, match=re.escape(message)):
        calibrate(str(tiny_dir), [str(text_file)], str(out), **BASE, resume=True)


def test_observer_and_granularity_may_change_on_resume(tiny_dir, text_file, tmp_path):
    """The scales come from the statistics at the end: a resume may choose others, and gets the statistics unchanged."""
    interrupted(tiny_dir, text_file, tmp_path / "out")
    resumed = calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "out"), **BASE, min_tokens=64, resume=True,
                        observer="mse", granularity="head")
    whole = calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "whole"), **BASE, min_tokens=64, checkpoint_every=0)
    assert_same_stats(resumed.stats, whole.stats)
    assert resumed.provenance["scales"]["observer"] == "mse" and resumed.provenance["scales"]["granularity"] == "head"


@pytest.mark.smoke
def test_a_resume_on_other_data_or_ranks_is_refused(tiny_dir, text_file, tmp_path, monkeypatch):
    """Refused before the model loads: a large model would otherwise load for minutes to be told no."""
    out = tmp_path / "out"
    interrupted(tiny_dir, text_file, out)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the resume was checked")

    monkeypatch.setattr("calibrate.model.load.load_model", no_load)
    state = resume_dir(out) / "state-rank0.json"
    saved = json.loads(state.read_text())
    state.write_text(json.dumps(saved | {"world": 2}))
    with pytest.raises(ValueError, match="the saved run had 2 torchrun ranks and this one has 1"):
        calibrate(str(tiny_dir), [str(text_file)], str(out), **BASE, resume=True)

    state.write_text(json.dumps(saved))
    with open(text_file, "a") as f:
        f.write(json.dumps({"text": "And one more verse, which the saved run never read."}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"data file {text_file} differs from the saved run's")):
        calibrate(str(tiny_dir), [str(text_file)], str(out), **BASE, resume=True)


def test_resume_without_a_save_and_a_fresh_run_over_one(tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out), "--seq-len", "64", "--quiet", "--no-verify"]
    assert main([*args, "--resume"]) == 2
    assert "--resume: there is no save to resume from" in capsys.readouterr().err

    interrupted(tiny_dir, text_file, out)
    assert main(args) == 2  # a fresh run would throw the save away
    assert "holds the save of an interrupted run of this --out; pass --resume" in capsys.readouterr().err
    assert main([*args, "--overwrite", "--checkpoint-every", "0"]) == 0  # starting over removes it
    assert out.is_dir() and not resume_dir(out).exists()


@pytest.mark.parametrize("value", [-1, 1.5, True, "100"])
def test_checkpoint_every_must_be_a_token_count(tiny_dir, text_file, tmp_path, value):
    config = CalibrationConfig(model=str(tiny_dir), data=[str(text_file)], out=str(tmp_path / "out"), checkpoint_every=value)
    with pytest.raises(ValueError, match="--checkpoint-every must be a number of tokens ≥ 0"):
        config.validate()


def test_resume_must_be_a_bool(tiny_dir, text_file, tmp_path):
    with pytest.raises(ValueError, match="resume must be True or False"):
        CalibrationConfig(model=str(tiny_dir), data=[str(text_file)], out=str(tmp_path / "out"), resume="yes").validate()


@pytest.fixture
def long_text(tmp_path):
    """About 100K tokens of KJV verses: a run long enough to be killed between two saves."""
    return kjv_jsonl(tmp_path / "long.jsonl", 3000)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # four runs of 65,536 tokens: over 600 s each on a loaded 2-core machine
def test_a_sigkilled_run_resumes_to_the_uninterrupted_result(tiny_dir, long_text, tmp_path):
    """SIGKILL mid-capture, --resume, and the statistics and scales are those of a run never killed; a copy of the
    save with one statistic altered shows the resumed run loaded the save (it carries the alteration) and captured
    only the rest (its other sums equal the uninterrupted run's, which a recount from the start would double)."""
    out, whole, altered = tmp_path / "out", tmp_path / "whole", tmp_path / "altered"
    base = [sys.executable, "-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(long_text), "--seq-len", "64",
            "--max-tokens", "65536", "--quiet", "--no-verify"]
    state = resume_dir(out) / "state-rank0.json"
    log, marker = tmp_path / "killed.log", tmp_path / "paused"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # this checkout's code
    pause = {"KVCAL_PAUSE_AT": "capture", "KVCAL_PAUSE_MARKER": str(marker)}  # layout.pause_at: held after a save
    with log.open("w") as err:
        proc = subprocess.Popen([*base, "--out", str(out), "--checkpoint-every", "2048"], stdout=subprocess.DEVNULL,
                                stderr=err, env=env | pause, **SIGINT_DEFAULT)
    try:
        deadline = time.monotonic() + 300  # against a hang only: the test goes on as soon as the marker appears
        while not marker.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no save within 300 s: {log.read_text()[-3000:]}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]  # killed, not finished
    assert not out.exists()
    saved = json.loads(state.read_text())
    assert saved["saves"] == 1 and 0 < saved["tokens"] < 65536 and (resume_dir(out) / saved["stats"]).is_file()

    # The same save beside another OUT (a save names no OUT), with every kind's sum of squares raised by BUMP.
    BUMP = 1e6
    shutil.copytree(resume_dir(out), resume_dir(altered))
    bumped = Stats.load(resume_dir(altered) / saved["stats"])
    for s in bumped.kinds.values():
        s.sumsq += BUMP
    bumped.save(resume_dir(altered) / saved["stats"])

    for target, extra in ((out, ["--resume"]), (altered, ["--resume"]), (whole, [])):
        every = "0" if target == whole else "2048"
        done = subprocess.run([*base, "--out", str(target), "--checkpoint-every", every, *extra], check=False,
                              capture_output=True, text=True, env=env, timeout=1200)
        assert done.returncode == 0, done.stderr[-3000:]

    (stats, provenance), (want, reference) = load_calibration(out), load_calibration(whole)
    assert int(stats.tokens.max()) == 65536
    assert_same_stats(stats, want)
    assert provenance["scales"]["scales"] == reference["scales"]["scales"]
    assert provenance["data"] == reference["data"]
    assert not resume_dir(out).exists()

    loaded, _ = load_calibration(altered)
    assert torch.equal(loaded.tokens, want.tokens)  # the saved count plus the rest, not the rest twice
    for kind, s in loaded.kinds.items():
        torch.testing.assert_close(s.sumsq, want.kinds[kind].sumsq + BUMP, rtol=1e-12, atol=1e-6, msg=kind)
        assert torch.equal(s.absmax, want.kinds[kind].absmax), kind


@pytest.mark.slow
def test_two_ranks_resume_their_own_shares(tiny_dir, text_file, tmp_path):
    """Under torchrun each rank saves and restores its own share; the merged result equals one process's, and a resume
    with another number of ranks is refused."""
    out, env = tmp_path / "out", dict(os.environ, OMP_NUM_THREADS="1")
    args = ["-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out), "--seq-len", "64",
            "--max-tokens", "100000", "--quiet", "--no-verify", "--dist-timeout", "30", "--checkpoint-every", "1000"]

    def torchrun(*extra: str) -> subprocess.CompletedProcess:
        cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), *args, *extra]
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)

    # Too few tokens for --min-tokens: rank 0 fails after the merge, and both ranks' saves stay, as after a kill.
    failed = torchrun("--min-tokens", "100000")
    assert failed.returncode != 0 and "fewer than the 100000 needed" in failed.stderr, failed.stderr[-3000:]
    states = [json.loads((resume_dir(out) / f"state-rank{rank}.json").read_text()) for rank in range(2)]
    assert [(state["rank"], state["world"]) for state in states] == [(0, 2), (1, 2)]
    assert all(state["sequences"] > 0 for state in states)

    with pytest.raises(ValueError, match="the saved run had 2 torchrun ranks and this one has 1"):
        calibrate(str(tiny_dir), [str(text_file)], str(out), **BASE, resume=True)

    done = torchrun("--min-tokens", "64", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    one = calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "one"), **BASE, min_tokens=64, checkpoint_every=0)
    stats, provenance = load_calibration(out)
    assert provenance["ranks"] == 2 and provenance["scales"]["scales"] == one.provenance["scales"]["scales"]
    assert provenance["data"] == one.provenance["data"]
    for kind, s in stats.kinds.items():
        for f in fields(s):
            got, want = getattr(s, f.name), getattr(one.stats.kinds[kind], f.name)
            exact = want.dtype != torch.float64  # counts and maxima exactly; float64 sums up to their order of addition
            torch.testing.assert_close(got, want, rtol=0 if exact else 1e-12, atol=0, msg=f"{kind}.{f.name}")
    assert not resume_dir(out).exists()


def test_a_resume_after_the_weights_changed_in_place_is_refused(tiny_dir, text_file, tmp_path):
    """Same file names and sizes, other weights (rewritten in place): a resume would mix two models' statistics."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    interrupted(tiny_dir, text_file, out)
    weights = tiny_dir / "model.safetensors"
    size, tensors = weights.stat().st_size, load_file(weights)
    save_file({name: t + 1 for name, t in tensors.items()}, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == size
    with pytest.raises(ValueError, match="model file model.safetensors differs from the saved run's") as e:
        calibrate(str(tiny_dir), [str(text_file)], str(out), **BASE, resume=True)
    assert "\n" not in str(e.value)
