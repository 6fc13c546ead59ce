"""Tests for calibrate/model/load.py: finding attention layers, the model signature, config reading, sizes, placement,
and refusing models that quantize K/V themselves.

Expected values come from elsewhere than the code under test: attention modules are found through the decoder's
own ``layers`` list, head counts from the projection weights' shapes, layer sizes by summing the parameters of a
real decoder layer (or by hand from the config), sliding layers from the ``layer_types`` the test writes.
"""

import json

import pytest
import torch
from builders import COMMON, CONFIGS, multimodal_config, save_tiny_checkpoint, tiny_config
from runners import hardware_reason
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from calibrate.model.description import read_config
from calibrate.model.layers import attention_layers, max_context, signature
from calibrate.model.load import (
    Placement,
    check_fits_one_layer,
    check_loaded,
    check_no_kv_quantization,
    decoder_layer_bytes,
    default_dtype,
    input_device,
    load_model,
    resolve_device,
    resolve_placement,
    without_kv_quantization,
)


def build(case: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[case][0]()).eval()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layer list, wherever the architecture keeps it."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


@pytest.mark.parametrize("case", list(CONFIGS))
def test_attention_layers_are_each_decoder_layers_self_attention_in_order(case):
    """Exactly one entry per decoder layer, named as the checkpoint names it; none from a vision tower."""
    model = build(case)
    names = {id(m): n for n, m in model.named_modules()}
    expected = [(i, names[id(layer.self_attn)], sliding) for i, (layer, sliding) in enumerate(zip(decoder_layers(model), CONFIGS[case][1]))]
    got = [(layer.layer_idx, layer.prefix, layer.sliding_window) for layer in attention_layers(model)]
    assert got == expected
    # The prefix is also the prefix of the attention's parameters in the state dict (what the checkpoint holds).
    state = model.state_dict()
    assert all(f"{prefix}.k_proj.weight" in state for _, prefix, _ in got)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_signature_matches_the_shapes_the_model_computes_with(case):
    """Head counts from the projection weights, head size from the attention module itself."""
    model = build(case)
    layers = attention_layers(model)
    attn = decoder_layers(model)[0].self_attn
    head_dim = attn.head_dim
    sig = signature(model, layers)
    assert sig.head_dim == head_dim
    assert sig.num_heads == attn.q_proj.weight.shape[0] // head_dim
    assert sig.num_kv_heads == attn.k_proj.weight.shape[0] // head_dim
    assert sig.layers == list(range(len(decoder_layers(model))))
    assert sig.model_type == model.config.get_text_config().model_type


@pytest.mark.smoke
def test_signature_head_dim_differs_from_hidden_over_heads():
    """The case that tells ``head_dim`` from ``hidden_size // heads`` apart is really in the table above."""
    model = build("qwen3-wide-heads")
    assert signature(model, attention_layers(model)).head_dim == 32 != COMMON["hidden_size"] // COMMON["num_attention_heads"]


@pytest.mark.smoke
def test_a_model_without_attention_layers_is_refused():
    class NoAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tiny_config("llama")
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="found no attention modules with a layer_idx in NoAttention"):
        attention_layers(NoAttention())


@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 8192}, 8192),
    ({"max_position_embeddings": 32768, "text_config": {"max_position_embeddings": 4096}}, 4096),
    ({"model_type": "llama"}, None),
], ids=["plain", "multimodal-text-config", "unknown"])
def test_max_context(config, expected):
    assert max_context(config) == expected


def test_max_context_of_a_saved_multimodal_config(tmp_path):
    config = multimodal_config()
    config.text_config.max_position_embeddings = 2048
    config.save_pretrained(tmp_path)
    assert max_context(read_config(tmp_path)) == 2048


# ---------------------------------------------------------------------------------------------------------------
# Sizes, dtypes and devices


def llama_layer_params(c: LlamaConfig) -> int:
    """Parameters of one Llama decoder layer, counted by hand: q, k, v, o, gate/up/down, two RMSNorm weights."""
    hd = c.hidden_size // c.num_attention_heads
    attention = c.hidden_size * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    return attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decoder_layer_bytes_of_llama_by_hand(dtype):
    config = tiny_config("llama")
    size = torch.finfo(dtype).bits // 8
    assert decoder_layer_bytes(config, dtype) == llama_layer_params(config) * size


@pytest.mark.parametrize("family", ["gemma2", "qwen2", "phi3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decoder_layer_bytes_equals_a_real_layers_tensors(family, dtype):
    """Extra norms (gemma2), projection biases (qwen2), fused projections (phi3): a real layer's tensors, summed."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=dtype)
    real = max(sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers())) for layer in model.model.layers)
    assert real > 0 and decoder_layer_bytes(tiny_config(family), dtype) == real


def test_check_fits_one_layer_needs_room_for_one_layer_on_a_computing_device():
    config = tiny_config("llama")
    needed = llama_layer_params(config) * 4
    check_fits_one_layer("m", config, torch.float32, {"cpu": needed})  # exactly enough
    check_fits_one_layer("m", config, torch.float32, {"cpu": 1, 0: needed})  # one device is enough
    with pytest.raises(ValueError, match=r"cannot hold one decoder layer of m, which needs .* in float32; .*cpu=1MiB"):
        check_fits_one_layer("m", config, torch.float32, {"cpu": needed - 1, "disk": 10 * needed})  # disk does not compute


@pytest.mark.parametrize("device, config, expected", [
    ("cpu", {"dtype": "bfloat16"}, torch.float32),
    ("cuda", {"dtype": "float16"}, torch.float16),
    ("cuda", {"torch_dtype": "float32"}, torch.float32),
    ("cuda", {}, torch.bfloat16),
    ("cuda", {"dtype": "no_such_dtype"}, torch.bfloat16),
], ids=["cpu-always-float32", "gpu-dtype", "gpu-old-torch_dtype-key", "gpu-default", "gpu-unknown-name"])
def test_default_dtype(device, config, expected):
    assert default_dtype(torch.device(device), config) == expected


def test_resolve_device_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name, message", [
    ("tpu", "is not a device; use auto, cpu, cuda or cuda:N"),
    ("cuda:x", "no CUDA GPU is visible" if not torch.cuda.is_available() else "is not a device"),
], ids=["unknown", "bad-cuda"])
def test_resolve_device_errors(name, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason=hardware_reason("no-gpu"))
def test_cuda_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="no CUDA GPU is visible; use --device cpu or auto"):
        resolve_device("cuda")


def test_resolve_placement_without_a_map_is_the_device():
    assert resolve_placement("cpu") == Placement(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason=hardware_reason("no-gpu"))
def test_resolve_placement_on_a_cpu_machine():
    budget = {"cpu": 2**30, "disk": 2**32}
    assert resolve_placement("auto", max_memory=budget) == Placement(torch.device("cpu"), "auto", budget, None)
    with pytest.raises(ValueError, match="names GPU 0, but 0 GPUs are visible; give cpu=SIZE"):
        resolve_placement("auto", max_memory={0: 2**30})


def test_input_device_follows_accelerates_execution_device():
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert input_device(model) == torch.device("cpu")

    class Hook:  # what accelerate attaches to an offloaded module
        execution_device = "cuda:1"

    model.get_input_embeddings()._hf_hook = Hook()
    assert input_device(model) == torch.device("cuda:1")


# ---------------------------------------------------------------------------------------------------------------
# Loads that must be refused, and KV quantization


@pytest.mark.parametrize("info, named", [
    ({"missing_keys": ["model.layers.1.mlp.up_proj.weight"]}, "model.layers.1.mlp.up_proj.weight"),
    ({"mismatched_keys": [("lm_head.weight", (256, 64), (300, 64))]}, "lm_head.weight"),
], ids=["missing", "mismatched"])
def test_check_loaded_refuses_freshly_initialised_parameters(info, named):
    with pytest.raises(ValueError, match=f"with 1 parameters missing .*{named}.*run kvcal inspect m"):
        check_loaded("m", info)


def test_check_loaded_accepts_a_complete_load():
    check_loaded("m", {"missing_keys": [], "mismatched_keys": [], "unexpected_keys": ["model.layers.0.self_attn.k_scale"]})


@pytest.mark.parametrize("where, name, kind", [
    ("self_attn", "k_scale", "parameter"),
    ("self_attn", "v_scale", "buffer"),
    ("self_attn.k_proj", "output_scale", "buffer"),
], ids=["k_scale-parameter", "v_scale-buffer", "output_scale"])
def test_check_no_kv_quantization_refuses_scale_tensors(where, name, kind):
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    check_no_kv_quantization(model)  # a plain model passes
    module = model.get_submodule(f"model.layers.1.{where}")
    if kind == "parameter":
        module.register_parameter(name, nn.Parameter(torch.ones(1)))
    else:
        module.register_buffer(name, torch.ones(1))
    with pytest.raises(ValueError, match=rf"quantizes its KV cache itself \(model\.layers\.1\.{where}\.{name}\), "):
        check_no_kv_quantization(model)


def test_check_no_kv_quantization_matches_whole_names_only():
    """``k_scaler`` is not a KV-cache scale: only the names vLLM maps (after a dot) are."""
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.model.layers[0].self_attn.register_buffer("k_scaler", torch.ones(1))
    check_no_kv_quantization(model)


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
WEIGHT_GROUPS = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}


@pytest.mark.parametrize("quant, expected", [
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": KV_SCHEME, "config_groups": {}}, None),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": KV_SCHEME, "config_groups": WEIGHT_GROUPS},
     {"quant_method": "compressed-tensors", "config_groups": WEIGHT_GROUPS}),
    ({"quant_method": "fp8", "kv_cache_scheme": "static"}, {"quant_method": "fp8", "kv_cache_scheme": "static"}),
], ids=["kv-only-removed", "weights-kept", "other-method-untouched"])
@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "text-config"])
def test_without_kv_quantization(quant, expected, nested):
    config = multimodal_config() if nested else tiny_config("llama")
    holder = config.get_text_config() if nested else config
    holder.quantization_config = json.loads(json.dumps(quant))
    without_kv_quantization(config)
    assert getattr(holder, "quantization_config", None) == expected


def test_load_model_drops_a_kv_only_scheme_and_computes_as_the_plain_model(tmp_path, smol_tokenizer):
    """A KV-only compressed-tensors config would make transformers quantize K and V: the load must not."""
    plain = save_tiny_checkpoint(tmp_path / "plain", "llama", smol_tokenizer)
    marked = save_tiny_checkpoint(tmp_path / "marked", "llama", smol_tokenizer)
    config = json.loads((marked / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": KV_SCHEME, "config_groups": {},
                                     "format": "dense", "quantization_status": "compressed"}
    (marked / "config.json").write_text(json.dumps(config))

    model, tokenizer = load_model(marked, device=torch.device("cpu"))
    assert not model.training and model.dtype == torch.float32
    assert not any("scale" in name for name, _ in [*model.named_parameters(), *model.named_buffers()])
    assert getattr(model.config, "quantization_config", None) is None
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(plain).eval()(ids).logits
        torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=0)
    assert len(tokenizer) == len(smol_tokenizer)
    assert AutoConfig.from_pretrained(marked).quantization_config["kv_cache_scheme"] == KV_SCHEME  # the source is untouched
