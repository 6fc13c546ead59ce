"""engine/launch.py: finding vLLM's interpreter and running a job in it, against the project's vLLM venv."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runners import FAULTING, OUT_OF_MEMORY, client_python, job_wrapper

from calibrate.engine.launch import EngineError, find_vllm_python, installed_vllm_version, run_job, vllm_version


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


# ---- real faults in a real job: an interpreter wrapper in tmp_path stands in for vLLM's python ----------------------

FAULTS = {"kill": "os.kill, (os.getpid(), signal.SIGKILL)", "segfault": "ctypes.string_at, (0,)"}


def _wrapper(tmp_path, python, version_job: str) -> Path:
    return job_wrapper(tmp_path, python, "version", version_job)


def _hanging(tmp_path, python) -> tuple[Path, Path]:
    """A wrapper whose version job starts a child of its own (vLLM's engine process, say) and never answers; the
    file that gets the child's pid."""
    pidfile = tmp_path / "child.pid"
    return _wrapper(tmp_path, python, f'sleep 600 & echo $! > "{pidfile}"; exec sleep 600'), pidfile


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie awaiting its reaper) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _wait_for(path: Path, within_s: float = 30.0) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    pytest.fail(f"{path} never appeared")


def test_a_job_killed_by_sigkill_is_an_engine_error_naming_the_signal(python, tmp_path):
    wrapper = _wrapper(tmp_path, python, f'exec "$PY" -c "{FAULTING.format(fault=FAULTS["kill"])}" "$@"')
    with pytest.raises(EngineError, match=r"^vLLM's version job crashed \(killed by SIGKILL \(out of memory, or killed "
                                          r"by another process\): ") as caught:
        run_job(wrapper, "version", {})
    assert caught.value.detail.startswith("killed by SIGKILL") and "\n" not in str(caught.value)


def test_a_job_that_segfaults_under_a_shell_is_exit_139(python, tmp_path):
    """A shell between kvcal and the crashed interpreter reports the segfault as exit 139 (128 + SIGSEGV)."""
    wrapper = _wrapper(tmp_path, python, f'"$PY" -c "{FAULTING.format(fault=FAULTS["segfault"])}" "$@"; exit $?')
    with pytest.raises(EngineError, match=r"^vLLM's version job crashed \(exit 139: "):
        run_job(wrapper, "version", {})


def test_a_job_out_of_memory_is_a_fault_not_a_refusal(python, tmp_path):
    """A MemoryError in the job's work (an allocation the machine cannot give) is the machine's, not vLLM's answer:
    an EngineError, where a refusal would be a result."""
    wrapper = _wrapper(tmp_path, python, OUT_OF_MEMORY)
    with pytest.raises(EngineError, match=r"^vLLM's version job failed: MemoryError") as caught:
        run_job(wrapper, "version", {})
    assert caught.value.detail.startswith("MemoryError")


def test_a_timeout_kills_the_jobs_whole_process_group(python, tmp_path):
    wrapper, pidfile = _hanging(tmp_path, python)
    with pytest.raises(EngineError, match="did not finish within 3 s"):
        run_job(wrapper, "version", {}, timeout_s=3)
    assert _gone(_wait_for(pidfile))


def test_ctrl_c_during_a_job_leaves_no_process_behind(python, tmp_path):
    wrapper, pidfile = _hanging(tmp_path, python)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_job(wrapper, "version", {}, timeout_s=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _gone(_wait_for(pidfile))


def test_sigterm_to_verify_during_a_job_exits_130_and_leaves_no_vllm_process(python, tiny_dir, tmp_path):
    """`kvcal verify --engine vllm` killed (SIGTERM) while vLLM's first job runs: the CLI unwinds as from Ctrl-C,
    the job's process group goes with it, nothing is written."""
    wrapper, pidfile = _hanging(tmp_path, python)
    data = tmp_path / "data.txt"
    data.write_text("a line of text to verify on. " * 400)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "calibrate", "verify", str(tiny_dir), "--data", str(data),
                             "--engine", "vllm", "--vllm-python", str(wrapper), "--report", str(tmp_path / "r"),
                             "--quiet"], stderr=subprocess.PIPE, text=True, env=env)
    child = _wait_for(pidfile, within_s=120)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "kvcal: interrupted; nothing was written"
    assert _gone(child) and not (tmp_path / "r").exists()


def test_the_installed_vllm_is_the_default_version(python):
    """The release the caveats are said for, when verify names none: the vLLM find_vllm_python finds."""
    assert installed_vllm_version() == vllm_version(python)
