"""The suite passes however it is launched: from a terminal, a non-interactive shell, in the background, under CI.

A shell without job control that starts a job in the background (``scripts/test &`` in a script, ``nohup``, some CI
runners) starts it with SIGINT ignored, and every child inherits that; Python then installs no KeyboardInterrupt
handler. The tests that interrupt a run therefore start their child with SIGINT at its default action themselves
(``runners.SIGINT_DEFAULT``, a ``preexec_fn``). This test launches those tests as such a background job would.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every test that sends SIGINT to a child (grep -rn SIGINT tests/).
INTERRUPT_TESTS = [
    "tests/test_cli.py::test_interrupted_run_leaves_no_output[ctrl-c]",
    "tests/e2e/test_faults.py::test_ctrl_c_in_the_short_verify_says_out_is_written_and_complete",
]


def _background_launch() -> None:
    """preexec_fn: the child starts as ``cmd &`` from a non-interactive shell starts it, with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_the_interrupt_tests_pass_when_launched_with_sigint_ignored():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INTERRUPT_TESTS],
                          cwd=REPO, capture_output=True, text=True, timeout=900, preexec_fn=_background_launch,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0 and f"{len(INTERRUPT_TESTS)} passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
