"""tests/conftest.py's skip policy: under KVCAL_REQUIRE_CLIENTS=1 only a missing-hardware skip stays a skip, and a
missing operating-system feature (runners.host_lacks) is a failure that names it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CASES = '''
import pytest
from runners import hardware_reason, hardware_skip, host_lacks

def test_hardware():
    hardware_skip("avx512", "this CPU")

@pytest.mark.skipif(True, reason=hardware_reason("gpu"))
def test_hardware_mark():
    pass

def test_other():
    pytest.skip("a client venv is missing")

@pytest.mark.skipif(True, reason="no reason worth the name")
def test_other_mark():
    pass

def test_host_feature():
    host_lacks("unprivileged user namespaces", "a sysctl")
'''


@pytest.mark.parametrize("required, failed", [("1", 3), ("", 0)], ids=["ci", "by-hand"])
def test_only_hardware_skips_pass_under_require_clients(tmp_path, required, failed):
    """A skip in the test fails it, a skipif mark fails its setup (an error), a missing OS feature fails with what the
    host lacks: either way the run fails."""
    for helper in ("conftest.py", "builders.py", "runners.py"):
        shutil.copy(Path(__file__).with_name(helper), tmp_path / helper)
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "KVCAL_REQUIRE_CLIENTS": required}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    last = proc.stdout.strip().splitlines()[-1]
    assert f"{5 - failed} skipped" in last and (proc.returncode != 0) == bool(failed), proc.stdout[-3000:]
    assert proc.stdout.count("skipped under KVCAL_REQUIRE_CLIENTS=1 for a reason that is not missing hardware") == min(failed, 2)
    if failed:
        assert " test_other _" in proc.stdout and "ERROR at setup of test_other_mark" in proc.stdout
        assert "this host lacks unprivileged user namespaces (a sysctl); provide it to run the suite" in proc.stdout
    else:
        assert "this host lacks unprivileged user namespaces (a sysctl)" in proc.stdout  # listed with its reason
    assert "SKIPPED" in proc.stdout and "hardware: needs an x86 CPU with AVX-512 or AMX (this CPU)" in proc.stdout  # -rs
