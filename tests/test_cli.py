"""cli.py: the command line, its errors, and what an interrupted or killed run leaves behind."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import save_tiny_checkpoint

from calibrate.cli import build_parser, main


@pytest.fixture
def tiny_dir(tmp_path, smol_tokenizer):
    return save_tiny_checkpoint(tmp_path / "tiny", "llama", smol_tokenizer)


def test_calibrate_then_export_from_the_command_line(tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out), "--seq-len", "64",
                 "--max-tokens", "128", "--quiet", "--no-verify"])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"vllm serve {out} --kv-cache-dtype fp8" in printed
    assert "k_scale" in printed and (out / "kvcal" / "stats.safetensors").is_file()

    code = main(["export", str(out), "--out", str(tmp_path / "head"), "--granularity", "head", "--observer", "mse"])
    printed = capsys.readouterr().out
    assert code == 0 and "FlashAttention-3" in printed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--observer", "median"], "unknown observer 'median'; choose one of: max, percentile:P, mse, sink-aware"),
        (["--observer", "percentile:101"], "the percentile must be in (0, 100]"),
        (["--seq-len", "0"], "--seq-len must be a positive integer"),
        (["--headroom", "0.5"], "--headroom must be a number ≥ 1.0"),
        (["--data", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
    ],
    ids=["observer", "percentile", "seq-len", "headroom", "missing-data"],
)
def test_bad_input_is_one_clear_line_and_nothing_written(tiny_dir, text_file, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    data = [] if "--data" in args else ["--data", str(text_file)]
    code = main(["calibrate", str(tiny_dir), *data, "--out", str(out), "--quiet", "--no-verify", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_every_subcommand_has_help():
    parser = build_parser()
    for command in ("calibrate", "export", "demo"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([command, "--help"])
        assert exc.value.code == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "term", "kill"])
def test_interrupted_run_leaves_no_output(tiny_dir, text_file, tmp_path, sig):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out),
           "--seq-len", "32", "--max-tokens", "100000", "--no-verify"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    line = ""
    while "calibrating" not in line and time.time() < deadline:  # wait until the model is running
        line = proc.stderr.read(64)
        if proc.poll() is not None:
            pytest.fail(f"kvcal exited early: {proc.stderr.read()}")
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not out.exists()
    if sig != signal.SIGKILL:
        assert "interrupted; nothing was written" in err
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
