"""engine/launch.py: finding vLLM's interpreter and running a job in it, against the project's vLLM venv."""

import sys

import pytest
from runners import client_python

from calibrate.engine.launch import EngineError, find_vllm_python, run_job, vllm_version


@pytest.fixture(scope="module")
def python():
    return client_python("vLLM")


@pytest.mark.smoke
def test_explicit_interpreter_without_vllm_is_one_line(tmp_path):
    with pytest.raises(EngineError, match="vLLM is not installed there; run scripts/setup-vllm"):
        find_vllm_python(sys.executable)
    with pytest.raises(EngineError, match="no such interpreter"):
        find_vllm_python(tmp_path / "python")


def test_job_reports_the_version_the_metadata_names_and_denies_isa(python):
    assert find_vllm_python(python) == python
    answer = run_job(python, "version", {})
    assert answer["error"] is None
    assert answer["result"]["vllm_version"] == vllm_version(python)
    denied = run_job(python, "version", {}, deny_isa=("avx512", "amx"))["result"]
    assert denied["avx512"] is False and denied["amx"] is False


def test_deadline_and_bad_requests(python):
    with pytest.raises(EngineError, match="did not finish within"):
        run_job(python, "version", {}, timeout_s=0.5)
    with pytest.raises(ValueError, match="unknown engine job"):
        run_job(python, "nonesuch", {})
    with pytest.raises(ValueError, match="unknown features"):
        run_job(python, "version", {}, deny_isa=("sse2",))
