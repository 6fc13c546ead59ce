"""verification/config.py (a basename apart from tests/test_config.py's: pytest imports test modules by it).
VerifyConfig.match_engine: with --engine, the engine's platform sets the emulation and the target; a flag the user
typed that contradicts a measured platform is refused in one line, and an unmeasured platform keeps what was typed."""

import re

import pytest
from runners import EndedJob

from calibrate.verification.config import VerifyConfig
from calibrate.vllm_facts.platforms import PLATFORMS, platform


def _config(tmp_path, **options) -> VerifyConfig:
    data = tmp_path / "t.txt"
    data.write_text("x " * 100)
    return VerifyConfig.from_options(str(tmp_path), [str(data)], engine="vllm", **options).validate()


def test_without_an_engine_the_defaults_are_cuda_q_quantized_and_gpu(tmp_path):
    data = tmp_path / "t.txt"
    data.write_text("x " * 100)
    config = VerifyConfig.from_options(str(tmp_path), [str(data)]).validate()
    assert (config.backend, config.kv_only, config.target) == ("cuda", False, "gpu")


def test_engine_alone_takes_vllm_cpus_writer_dtype_q_and_target(tmp_path):
    config = _config(tmp_path)
    assert (config.backend, config.kv_only, config.target) == (None, None, None)  # not decided before the engine answers
    line = config.match_engine("CpuPlatform", platform("CpuPlatform"))
    assert (config.backend, config.dtype, config.kv_only, config.target) == ("cpu", "bfloat16", True, "cpu")
    assert "--backend cpu --dtype bfloat16 --kv-only" in line and "target cpu" in line and "measured" in line
    assert "\n" not in line


@pytest.mark.parametrize(("typed", "named"), [
    ({"backend": "cuda"}, "--backend cuda contradicts --engine vllm on CpuPlatform"),
    ({"dtype": "float32"}, "--dtype float32 contradicts"),
    ({"target": "gpu"}, "--target gpu with --engine vllm on CpuPlatform: the engine's figures are target cpu's"),
])
def test_a_typed_flag_that_contradicts_the_measured_platform_is_refused(tmp_path, typed, named):
    config = _config(tmp_path, **typed)
    with pytest.raises(ValueError, match=re.escape(named)) as refused:
        config.match_engine("CpuPlatform", platform("CpuPlatform"))
    assert "\n" not in str(refused.value)


def test_typed_flags_that_agree_with_the_platform_are_kept(tmp_path):
    config = _config(tmp_path, backend="cpu", dtype="bfloat16", kv_only=True, target="cpu")
    config.match_engine("CpuPlatform", platform("CpuPlatform"))
    assert (config.backend, config.dtype, config.kv_only, config.target) == ("cpu", "bfloat16", True, "cpu")


def test_a_gpu_engine_sets_its_writer_and_target_and_keeps_the_typed_q_handling(tmp_path):
    """No like-for-like pair was measured on a GPU: what the user typed about Q and dtype is not contradicted."""
    config = _config(tmp_path, kv_only=True, dtype="float16")
    line = config.match_engine("CudaPlatform", platform("CudaPlatform"))
    assert (config.backend, config.dtype, config.kv_only, config.target) == ("cuda", "float16", True, "gpu")
    assert "never measured beside this engine" in line
    config = _config(tmp_path)
    config.match_engine("RocmPlatform", platform("RocmPlatform"))
    assert (config.backend, config.dtype, config.kv_only, config.target) == ("triton", None, True, "rocm")
    with pytest.raises(ValueError, match="--target cpu with --engine vllm on CudaPlatform"):
        _config(tmp_path, target="cpu").match_engine("CudaPlatform", platform("CudaPlatform"))


def test_an_unknown_platform_is_one_line():
    with pytest.raises(ValueError, match="runs on XpuPlatform, which kvcal has no facts for"):
        platform("XpuPlatform")


def test_every_platform_names_a_target_and_a_writer_kvcal_knows():
    from calibrate.choices import BACKENDS, TARGETS

    assert {p.target for p in PLATFORMS.values()} == set(TARGETS)
    assert {p.emulation.backend for p in PLATFORMS.values()} <= set(BACKENDS)
    assert [name for name, p in PLATFORMS.items() if p.measured] == ["CpuPlatform"]  # the only twin measured so far


def test_tensor_parallel_engine_runs_are_refused_in_one_line_saying_why(tmp_path):
    """--tp is vLLM's tensor-parallel size under --engine; the jobs read inside vLLM's one in-process worker, so only
    1 runs, and 2 says why in one line; without --engine --tp 2 is the memory arithmetic's and is taken."""
    assert _config(tmp_path, tp=1).tp == 1
    with pytest.raises(ValueError) as e:
        _config(tmp_path, tp=2)
    assert str(e.value).startswith("--tp 2 with --engine vllm: kvcal's engine jobs read log-probabilities and scales "
                                   "inside vLLM's one in-process worker") and "\n" not in str(e.value)
    data = tmp_path / "t.txt"
    assert VerifyConfig.from_options(str(tmp_path), [str(data)], tp=2).validate().tp == 2


def test_a_request_carries_the_tensor_parallel_size_to_vllm(tmp_path, monkeypatch):
    """The size reaches the job's LLM(...) through every run's request (engine.run_schemes)."""
    from calibrate.verification import engine

    seen = []

    def refused(python, job, request, **_):  # a job that refuses at once: the request is what matters here
        seen.append(request)
        return EndedJob(tmp_path, {"error": "refused", "fault": None, "result": None})

    monkeypatch.setattr(engine, "Job", refused)
    host = engine.EngineHost(tmp_path, "0", "CpuPlatform")
    engine.run_schemes(host, tmp_path, ["auto"], [[1, 2]], dtype="auto", chunk_len=8, max_model_len=32, block_size=32,
                       kv_bytes=1, vocab_size=4, workdir=tmp_path, tensor_parallel_size=1)
    assert seen[0]["tensor_parallel_size"] == 1
