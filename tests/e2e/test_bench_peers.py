"""scripts/bench_peers.py at tiny settings: every contender runs, every ratio is a number, and the scales agree.

The contenders run in llm-compressor's venv (scripts/setup-llmcompressor); the timings at these settings mean nothing,
the point is that a full benchmark run will not die halfway. `--chunk-len 32` makes kvcal and the bare forward run
chunked prefill in both settings, while llm-compressor runs each sequence in one forward: their static_minmax scales
must still equal kvcal's max scales to float32 rounding.
"""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from runners import client_python

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SETTINGS = ("short", "long")
CONTENDERS = ("bare", "kvcal", "llmc-basic", "llmc-sequential")
ROW = re.compile(r"^(\w+) +([\w-]+) +([\d.]+) +([\d.]+)x +([\d.]+) +(\d+)$", re.MULTILINE)
SCALES = re.compile(r"^(\w+): scales of ([\w-]+) \(static_minmax\) vs kvcal max: max relative difference (\S+) over 30 layers",
                    re.MULTILINE)


def test_every_contender_runs_and_the_scales_agree(smol_dir, kjv_path):
    client_python("llm-compressor")  # bench_peers runs llm-compressor in its venv: skip, or fail in CI, without it
    cmd = [sys.executable, str(REPO / "scripts" / "bench_peers.py"), "--rounds", "1", "--sequences", "2", "--seq-len", "64",
           "--long", "96", "--chunk-len", "32", "--llmc-observer", "static_minmax"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout

    assert re.search(r"^environment: torch .*llmcompressor .*torch threads \d+", out, re.MULTILINE), out
    rows = {(setting, name): (float(seconds), float(ratio), float(peak), int(tokens))
            for setting, name, seconds, ratio, peak, tokens in ROW.findall(out)}
    assert sorted(rows) == sorted((s, c) for s in SETTINGS for c in CONTENDERS), out
    for (setting, name), (seconds, ratio, peak, tokens) in rows.items():
        assert seconds > 0 and math.isfinite(ratio) and ratio > 0 and peak > 0, (setting, name, out)
        assert tokens == (128 if setting == "short" else 96)
    assert all(rows[s, "bare"][1] == 1.0 for s in SETTINGS)

    agreement = {(setting, pipeline): float(diff) for setting, pipeline, diff in SCALES.findall(out)}
    assert sorted(agreement) == sorted((s, p) for s in SETTINGS for p in ("llmc-basic", "llmc-sequential")), out
    assert all(diff < 1e-5 for diff in agreement.values()), agreement
