"""calibrate/model/description.py: what config.json says the model is, checked against the model transformers builds
from the same config (its own attention modules, its own config object) and against hand-worked cases."""

import json

import pytest
import torch
from builders import CONFIGS
from transformers import AutoModelForCausalLM

from calibrate.model.description import describe, describe_config, read_config, read_config_file
from calibrate.model.layers import ModelSignature, attention_layers, signature


@pytest.mark.parametrize("case", ["llama", "qwen3-wide-heads", "qwen2-sliding", "gemma3-text", "gemma3-multimodal"])
def test_the_description_is_the_loaded_models(tmp_path, case):
    """What export checks statistics against, the sliding layers, the depth and the context must be what the model
    built from the same config has: calibrate records those from the model itself."""
    config = CONFIGS[case][0]()
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    layers = attention_layers(model)
    described = describe(tmp_path)
    assert described.signature([layer.layer_idx for layer in layers]) == signature(model, layers)
    assert described.sliding == {layer.layer_idx for layer in layers if layer.sliding_window}
    assert described.num_layers == len(layers)
    assert described.context == model.config.get_text_config().max_position_embeddings
    assert described.mla is None and described.quant is None


def test_the_signature_falls_back_as_transformers_does(tmp_path):
    """No num_key_value_heads: one KV head per query head; no head_dim: hidden_size // heads."""
    sig = describe_config(tmp_path, {"model_type": "llama", "num_attention_heads": 8, "hidden_size": 256}).signature([0, 1])
    assert sig == ModelSignature("llama", [0, 1], num_kv_heads=8, num_heads=8, head_dim=32)


def test_latent_attention_and_a_quantization_config_are_described(tmp_path):
    """MLA: one cached row of kv_lora_rank + qk_rope_head_dim; the quantization config is config.json's own."""
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    config = {"model_type": "deepseek_v3", "num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2,
              "kv_lora_rank": 32, "qk_rope_head_dim": 8, "quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(config))
    described = describe_config(tmp_path, config)
    assert described.mla == (32, 8) and described.quant == quant and described.sliding == frozenset()
    assert described.signature([0, 1]) == ModelSignature("deepseek_v3", [0, 1], num_kv_heads=1, num_heads=4, head_dim=40,
                                                         latent_dim=32)


# ---------------------------------------------------------------------------------------------------------------
# Reading config.json


def write(directory, text: str):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(text)
    return directory


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "nope", "does not exist"),
    (lambda d: (d / "file").write_text("x") and d / "file", "is a file"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "has no config.json"),
    (lambda d: write(d / "bad", "{not json"), "is not valid JSON"),
    (lambda d: write(d / "list", "[1, 2]"), "holds a list, not a JSON object"),
], ids=["missing", "file", "no-config", "not-json", "not-an-object"])
def test_read_config_file_errors_are_one_line(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=message) as e:
        read_config_file(path)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=message):
        read_config(path)  # read_config reads through it


@pytest.mark.parametrize("architectures, accepted", [
    (["LlamaForCausalLM"], True),
    (["Gemma3ForConditionalGeneration"], True),
    ([], True),  # unknown: the load itself decides
    (["BertModel"], False),
    (["LlamaForSequenceClassification"], False),
], ids=["causal-lm", "image-text", "none", "encoder", "classifier"])
def test_read_config_refuses_what_is_not_a_causal_lm(tmp_path, architectures, accepted):
    config = {"model_type": "llama", "architectures": architectures}
    write(tmp_path / "m", json.dumps(config))
    if accepted:
        assert read_config(tmp_path / "m") == config
    else:
        with pytest.raises(ValueError, match=f"holds a {architectures[0]}; kvcal calibrates the decoders vLLM serves with a KV cache"):
            read_config(tmp_path / "m")
    assert read_config_file(tmp_path / "m") == config  # the plain reader never judges the architecture
