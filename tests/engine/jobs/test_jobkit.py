"""calibrate/engine/jobs/jobkit.py: vLLM's refusal is the job's result (``error``), the machine's fault is not
(``fault``), whatever exception carries it."""

import errno
import json
import sys

import pytest
from runners import import_job


@pytest.fixture
def jobkit(monkeypatch):
    """The module as a job imports it: a script beside it, by that name."""
    return import_job(monkeypatch, "jobkit")


def _answer(jobkit, tmp_path, monkeypatch, error: Exception) -> dict:
    (tmp_path / "in.json").write_text("{}")
    monkeypatch.setattr(sys, "argv", ["job.py", str(tmp_path / "in.json"), str(tmp_path / "out.json")])

    def work(request):
        raise error

    jobkit.run(work)
    return json.loads((tmp_path / "out.json").read_text())


def _wrapped(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as e:
            raise outer from e
    except Exception as e:  # noqa: BLE001 - the chain as vLLM raises it
        return e


@pytest.mark.parametrize(("error", "key", "text"), [
    pytest.param(ValueError("FP8 KV cache on CPU requires AVX-512"), "error", "ValueError: FP8 KV cache on CPU requires AVX-512",
                 id="vllm-refusal"),
    pytest.param(MemoryError("no room"), "fault", "MemoryError: no room", id="memory"),
    pytest.param(OSError(errno.ENOSPC, "No space left on device", "/tmp/x.npy"), "fault",
                 "OSError: [Errno 28] No space left on device: '/tmp/x.npy'", id="disk-full"),
    pytest.param(OSError(errno.ENOENT, "No such file or directory", "config.json"), "error",
                 "FileNotFoundError: [Errno 2] No such file or directory: 'config.json'", id="missing-file-is-a-refusal"),
    pytest.param(_wrapped(RuntimeError("engine core failed"), MemoryError("no room")), "fault", "MemoryError: no room",
                 id="fault-under-a-wrapper"),
])
def test_a_fault_is_told_from_a_refusal(jobkit, tmp_path, monkeypatch, error, key, text):
    answer = _answer(jobkit, tmp_path, monkeypatch, error)
    other = "error" if key == "fault" else "fault"
    assert answer[key] == text and answer[other] is None and answer["result"] is None
