"""calibrate/engine/jobs/logprobs.py, the parts that need no vLLM: the runner step it wraps, or a one-line refusal
where a vLLM release no longer has it (0.34 removed the V1 model runner; docs/engine.md, "Which vLLM")."""

from types import SimpleNamespace

import pytest
from builders import LATER
from runners import import_job

from calibrate.vllm_facts.release import READ_IN


@pytest.fixture
def logprobs(monkeypatch):
    """The job module as launch.py runs it: a script beside jobkit, which it imports by that name."""
    return import_job(monkeypatch, "logprobs")


def test_the_v1_runner_step_is_the_one_wrapped(logprobs):
    def step(*args, **kwargs):
        return "vLLM's own"

    assert logprobs._prompt_step(SimpleNamespace(_get_prompt_logprobs_dict=step), READ_IN) is step


def test_a_runner_without_it_is_refused_naming_the_release_and_the_fix(logprobs):
    class GPUModelRunner:  # 0.34's runner: prompt log-probabilities through a worker object, no such method
        prompt_logprobs_worker = object()

    with pytest.raises(RuntimeError) as refused:
        logprobs._prompt_step(GPUModelRunner(), LATER)
    message = str(refused.value)
    assert "\n" not in message and f"vLLM {LATER}'s model runner (GPUModelRunner)" in message
    assert "scripts/setup-vllm" in message and "--vllm-python" in message
