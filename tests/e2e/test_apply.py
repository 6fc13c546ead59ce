"""Tests for ``kvcal apply`` (calibrate/api.py, ``apply``) and the interop forms export writes into: a fine-tune, an
llm-compressor FP8-weight checkpoint with old KV scales, and ModelOpt FP8 checkpoints (both config layouts).

The FP8 checkpoints are built here by hand from a tiny model's weights, so every tensor the output must keep is known.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from builders import LINEARS, fp8, modelopt_fp8, save_tiny_checkpoint
from safetensors.torch import load_file, save_file

from calibrate import calibrate, export
from calibrate.checkpoint.inspect import inspect
from calibrate.checkpoint.write import check_index, scales_file, shard_name
from calibrate.cli import main
from calibrate.model.directory import INDEX_FILE, tensor_names


@pytest.fixture(scope="module")
def source(tmp_path_factory, smol_tokenizer, kjv_path) -> Path:
    """A kvcal calibration of a tiny llama."""
    root = tmp_path_factory.mktemp("apply")
    text = root / "data.txt"
    text.write_text("".join(json.loads(line)["text"] + "\n" for _, line in zip(range(80), open(kjv_path))))
    model = save_tiny_checkpoint(root / "base", "llama", smol_tokenizer, seed=0)
    calibrate(str(model), [str(text)], str(root / "calibrated"), seq_len=64, max_tokens=192, progress=False, verify=False)
    return root / "calibrated"


@pytest.fixture(scope="module")
def source_scales(source) -> dict[str, torch.Tensor]:
    return load_file(scales_file(source))


def all_names(directory: Path) -> list[str]:
    return [n for p in sorted(directory.glob("*.safetensors")) for n in tensor_names(p)]


def test_apply_to_a_fine_tune_writes_the_calibrated_scales(source, source_scales, tmp_path, smol_tokenizer):
    target = save_tiny_checkpoint(tmp_path / "finetune", "llama", smol_tokenizer, seed=1)
    out = tmp_path / "out"
    assert main(["apply", str(source), str(target), "--out", str(out)]) == 0

    written = load_file(scales_file(out))
    assert written.keys() == source_scales.keys()
    assert all(torch.equal(written[n], source_scales[n]) for n in written)  # the calibration's scales, bit for bit
    assert os.stat(out / shard_name(1, 2)).st_ino == os.stat(target / "model.safetensors").st_ino  # the target's weights
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert provenance["exported_from"] == str(source.resolve())
    assert inspect(str(out)).ok(strict=True)


def test_apply_after_the_output_observer_writes_the_source_s_scales(source, tmp_path, smol_tokenizer, kjv_path):
    """The output observer's scales cannot be re-derived from statistics: apply writes the recorded ones, exactly."""
    text = tmp_path / "data.txt"
    text.write_text("".join(json.loads(line)["text"] + "\n\n" for _, line in zip(range(200), open(kjv_path))))  # a record a verse
    model = save_tiny_checkpoint(tmp_path / "base", "llama", smol_tokenizer, seed=0)
    searched = tmp_path / "searched"
    calibrate(str(model), [str(text)], str(searched), seq_len=64, max_tokens=192, observer="output", progress=False,
              verify=False)
    target = save_tiny_checkpoint(tmp_path / "finetune", "llama", smol_tokenizer, seed=1)
    out = tmp_path / "out"
    assert main(["apply", str(searched), str(target), "--out", str(out)]) == 0
    written, wanted = load_file(scales_file(out)), load_file(scales_file(searched))
    assert written.keys() == wanted.keys() and all(torch.equal(written[n], wanted[n]) for n in written)
    assert json.loads((out / "kvcal" / "calibration.json").read_text())["scales"]["observer"] == "output"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": 2}, "has 2 attention layers and"),
        ({"num_hidden_layers": 4}, "has 4 attention layers and"),
        ({"num_key_value_heads": 4}, "num_kv_heads is 2 in the statistics but 4 in the model"),
        ({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}, "num_heads is 4 in the statistics but 8"),
    ],
)
def test_apply_refuses_another_architecture(source, tmp_path, smol_tokenizer, capsys, changes, message):
    target = save_tiny_checkpoint(tmp_path / "other", "llama", smol_tokenizer, seed=1, **changes)
    assert main(["apply", str(source), str(target), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_apply_needs_a_kvcal_source_and_a_checkpoint(source, tmp_path, smol_tokenizer, capsys):
    target = save_tiny_checkpoint(tmp_path / "t", "llama", smol_tokenizer, seed=1)
    assert main(["apply", str(target), str(target), "--out", str(tmp_path / "o")]) == 2
    assert "pass a directory written by kvcal calibrate" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["apply", str(source), str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "has no config.json" in capsys.readouterr().err


def llm_compressor_fp8(target: Path, directory: Path) -> Path:
    """An llm-compressor FP8-weight checkpoint of ``target``: two shards, old KV scales (9.0) in the second only."""
    weights = load_file(target / "model.safetensors")
    tensors = {}
    for name, value in weights.items():
        if name.endswith(tuple(f"{proj}.weight" for proj in LINEARS)):
            tensors[name], tensors[name.replace(".weight", ".weight_scale")] = fp8(value, per_channel=True)
        else:
            tensors[name] = value
    old_kv = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([9.0]) for i in range(3) for kind in "kvq"}
    first = {n: t for n, t in tensors.items() if n.startswith(("model.embed_tokens", "model.layers.0."))}
    second = {n: t for n, t in tensors.items() if n not in first} | old_kv
    directory.mkdir()
    save_file(first, str(directory / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {n: "model-00002-of-00002.safetensors" for n in second}
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True},
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
    }
    (directory / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / extra, directory / extra)
    return directory


def test_merge_into_llm_compressor_fp8_checkpoint(source, source_scales, tmp_path, smol_tokenizer):
    fp8_dir = llm_compressor_fp8(save_tiny_checkpoint(tmp_path / "t", "llama", smol_tokenizer, seed=1), tmp_path / "fp8")
    shard1, shard2 = (fp8_dir / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    old_config = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    out = tmp_path / "merged"
    assert main(["apply", str(source), str(fp8_dir), "--out", str(out)]) == 0

    # Its config is kept: only kv_cache_scheme is (re)written.
    new_config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in new_config.items() if k != "kv_cache_scheme"} == {k: v for k, v in old_config.items() if k != "kv_cache_scheme"}
    assert new_config["kv_cache_scheme"]["strategy"] == "tensor" and new_config["kv_cache_scheme"]["dynamic"] is False
    # The shard without old scales is linked as it is; the one with them is rewritten without them, all else bitwise.
    # Both are renumbered: two weight shards and the scales make three.
    out1, out2 = out / shard_name(1, 3), out / shard_name(2, 3)
    assert os.stat(out1).st_ino == os.stat(shard1).st_ino and scales_file(out) == out / shard_name(3, 3)
    before, after = load_file(shard2), load_file(out2)
    assert os.stat(out2).st_ino != os.stat(shard2).st_ino
    assert after.keys() == {n for n in before if not n.endswith(("k_scale", "v_scale", "q_scale"))}
    assert all(torch.equal(after[n].view(torch.uint8), before[n].view(torch.uint8)) for n in after)
    # Every KV scale name is stored once, with the calibrated value (never the old 9.0).
    names = all_names(out)
    assert len(names) == len(set(names)) and set(source_scales) <= set(names)
    check_index(out)
    found = inspect(str(out))
    assert found.ok(strict=True), found.text()
    assert [layer.scales["k"].value[0] for layer in found.layers] == [source_scales[f"model.layers.{i}.self_attn.k_scale"].item() for i in range(3)]


@pytest.mark.parametrize("in_config", [False, True], ids=["hf_quant_config-only", "config.json-too"])
def test_modelopt_source_gets_the_modelopt_form(source, source_scales, tmp_path, smol_tokenizer, in_config):
    mo = modelopt_fp8(save_tiny_checkpoint(tmp_path / "t", "llama", smol_tokenizer, seed=1), tmp_path / "mo", in_config=in_config)
    old_config, old_hf = (json.loads((mo / f).read_text()) for f in ("config.json", "hf_quant_config.json"))
    out = tmp_path / "out"
    assert main(["apply", str(source), str(mo), "--out", str(out)]) == 0

    written = load_file(scales_file(out))
    expected = {}
    for i in range(3):
        p = f"model.layers.{i}.self_attn"
        expected |= {f"{p}.k_proj.k_scale": source_scales[f"{p}.k_scale"], f"{p}.v_proj.v_scale": source_scales[f"{p}.v_scale"],
                     f"{p}.q_scale": source_scales[f"{p}.q_scale"]}
    assert written.keys() == expected.keys() and all(torch.equal(written[n], expected[n]) for n in expected)
    names = all_names(out)
    assert len(names) == len(set(names)) and not any(n.endswith("self_attn.k_scale") for n in names)
    kept = load_file(out / shard_name(1, 2))
    assert kept.keys() == {n for n in load_file(mo / "model.safetensors") if not n.endswith(("k_proj.k_scale", "v_proj.v_scale"))}

    new_hf = json.loads((out / "hf_quant_config.json").read_text())
    assert new_hf == old_hf | {"quantization": old_hf["quantization"] | {"kv_cache_quant_algo": "FP8"}}
    new_config = json.loads((out / "config.json").read_text())
    if in_config:
        scheme = {"num_bits": 8, "type": "float", "dynamic": False}
        assert new_config["quantization_config"] == old_config["quantization_config"] | {"kv_cache_scheme": scheme}
    else:
        assert new_config == old_config  # no compressed-tensors config, which vLLM would read instead of ModelOpt's

    found = inspect(str(out))
    assert found.producer == "kvcal" and found.quant_method == "modelopt" and found.ok(strict=True), found.text()
    assert found.layers[1].scales["k"].tensor == "model.layers.1.self_attn.k_proj.k_scale"
    assert found.layers[1].scales["v"].value == [source_scales["model.layers.1.self_attn.v_scale"].item()]


def test_modelopt_refuses_per_head_scales(source, tmp_path, smol_tokenizer, capsys):
    per_head = tmp_path / "per-head"
    export(str(source), str(per_head), granularity="head")
    mo = modelopt_fp8(save_tiny_checkpoint(tmp_path / "t", "llama", smol_tokenizer, seed=1), tmp_path / "mo", in_config=False)
    assert main(["apply", str(per_head), str(mo), "--out", str(tmp_path / "o")]) == 2
    assert "whose vLLM loader takes one scalar KV scale per layer" in capsys.readouterr().err and not (tmp_path / "o").exists()
