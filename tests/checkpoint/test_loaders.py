"""checkpoint/loaders.py (and the names model/directory.py reads): what vLLM reads, and what it multiplies loaded scales by, for every form kvcal writes.

Every form × FP8 format goes through write (calibrate, apply) → read (inspect, as vLLM would) → the value vLLM
uses after its loader's adjustment, which must be the calibrated scale in the format's own units.
"""

import re

import pytest
import torch
from builders import modelopt_fp8, save_tiny_checkpoint

from calibrate import apply, calibrate, inspect
from calibrate.model.directory import KV_SCALE_PATTERN
from calibrate.vllm_facts.loaders import SCALE_SOURCES, WRITE_NAMES, Servable, loaded_multiplier, refusal

# vLLM READ_IN (docs/vllm-notes.md, "ROCm fnuz"): the base KV loader (fp8, ModelOpt, Quark, legacy) doubles loaded
# scales on e4m3fnuz; the compressed-tensors loader never does; nothing is doubled on e4m3fn.
MULTIPLIERS = {
    ("compressed-tensors", "e4m3fn"): 1.0, ("compressed-tensors", "e4m3fnuz"): 1.0,
    ("modelopt", "e4m3fn"): 1.0, ("modelopt", "e4m3fnuz"): 2.0,
    ("fp8", "e4m3fnuz"): 2.0, ("quark", "e4m3fnuz"): 2.0, (None, "e4m3fnuz"): 2.0,
}


@pytest.mark.parametrize("method, fmt", list(MULTIPLIERS))
def test_loaded_multiplier_per_loader(method, fmt):
    assert loaded_multiplier(method, fmt) == MULTIPLIERS[method, fmt]


@pytest.mark.smoke
def test_every_written_name_is_one_vllm_maps_and_kvcal_replaces():
    for form, names in WRITE_NAMES.items():
        for kind, suffix in names.items():
            assert SCALE_SOURCES[suffix] == (kind, None), (form, kind)  # mapped whatever the quantization method
            assert KV_SCALE_PATTERN.search(f"model.layers.0.self_attn.{suffix}")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_norm.weight", "model.norm.weight"):
        assert not KV_SCALE_PATTERN.search(name)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_every_form_and_format_loads_the_calibrated_scales(tmp_path, smol_tokenizer, text_file, fmt):
    source = save_tiny_checkpoint(tmp_path / "model", "llama", smol_tokenizer, seed=0)
    result = calibrate(str(source), [str(text_file)], str(tmp_path / "ct"), seq_len=64, max_tokens=192, fp8_format=fmt,
                       progress=False, verify=False)
    modelopt = modelopt_fp8(save_tiny_checkpoint(tmp_path / "t", "llama", smol_tokenizer, seed=1), tmp_path / "mo-source", in_config=False)
    outputs = {"compressed-tensors": result.out, "modelopt": apply(str(result.out), str(modelopt), str(tmp_path / "mo")).out}
    for form, out in outputs.items():
        found = inspect(str(out))
        assert found.quant_method == form and found.ok(), found.text()
        for row, layer in enumerate(found.layers):
            for kind in ("k", "v", "q"):
                assert layer.scales[kind].tensor == f"{layer.prefix}.{WRITE_NAMES[form][kind]}"
                used = torch.tensor(layer.scales[kind].value) * loaded_multiplier(form, fmt)  # what vLLM computes with
                torch.testing.assert_close(used, result.scale_set.scales[kind][row].reshape(1), rtol=0, atol=0)
    # On e4m3fnuz the ModelOpt form stores half the compressed-tensors value: vLLM's base loader doubles it back.
    stored = {form: [layer.scales["k"].value[0] for layer in inspect(str(out)).layers] for form, out in outputs.items()}
    ratio = torch.tensor(stored["compressed-tensors"]) / torch.tensor(stored["modelopt"])
    assert ratio.tolist() == [MULTIPLIERS["modelopt", fmt]] * len(ratio)


def test_verify_and_inspect_complete_a_missing_v_scale_alike(tmp_path, smol_tokenizer, text_file):
    """vLLM copies k_scale into a missing v_scale: verify must emulate what inspect reports, not 1.0."""
    from safetensors.torch import load_file, save_file

    from calibrate.checkpoint.read import read_scales
    from calibrate.checkpoint.write import scales_file
    from calibrate.model.layers import AttentionLayer, ModelSignature

    source = save_tiny_checkpoint(tmp_path / "model", "llama", smol_tokenizer, seed=0)
    out = calibrate(str(source), [str(text_file)], str(tmp_path / "ct"), seq_len=64, max_tokens=192,
                    progress=False, verify=False).out
    path = scales_file(out)
    save_file({n: t for n, t in load_file(path).items() if not n.endswith("v_scale")}, str(path))
    found = inspect(str(out))
    layers = [AttentionLayer(layer.index, layer.prefix, False) for layer in found.layers]
    sig = ModelSignature(model_type="llama", layers=[layer.layer_idx for layer in layers], num_kv_heads=2, num_heads=4, head_dim=16)
    scales, granularity, notes = read_scales([p for p in out.glob("*.safetensors")], layers, sig, "compressed-tensors")
    for row, layer in enumerate(found.layers):
        assert layer.scales["v"].value == layer.scales["k"].value  # inspect: vLLM's copy
        assert scales["v"][row].tolist() == [layer.scales["k"].value[0]] * 2  # verify: the same, per KV head
    assert granularity == "tensor" and any("copies k_scale" in n for n in notes)


@pytest.mark.parametrize("name, checkpoint, refused", [
    ("fp8_e5m2", Servable("compressed-tensors", True, False), True),  # kvcal's own output: KV scales in the config
    ("fp8_e5m2", Servable("compressed-tensors", False, False), False),  # weight-only compressed-tensors keeps e5m2
    ("fp8_e5m2", Servable(None, False, False), False),  # no quantization config at all
    *[("fp8_e5m2", Servable(m, False, False), True) for m in ("fp8", "modelopt", "quark")],
    ("nvfp4", Servable(None, False, True), True),
    ("nvfp4_4over6", Servable("compressed-tensors", True, True), True),
    ("nvfp4", Servable("modelopt", False, False), False),
    *[("head", Servable(m, False, False, "head"), True) for m in ("fp8", "modelopt", "quark")],
    ("head", Servable("compressed-tensors", True, False, "head"), False),
    ("fp8", Servable("fp8", False, True, "tensor"), False),
    ("fp8_per_token_head", Servable("compressed-tensors", True, False, "tensor"), False),
])
def test_refusal_is_vllms_rule_for_the_checkpoint(name, checkpoint, refused):
    why = refusal(name, checkpoint)
    assert (why is not None) == refused
    assert why is None or why.startswith("not servable from this checkpoint: vLLM refuses it with '")


# One row per quant_method of loaders.QUANT_METHODS that kvcal refuses: (quantization_config, fragment of the reason).
REFUSED = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "no KV-cache method"),
    "gptq_marlin": ({"quant_method": "gptq_marlin", "bits": 4}, "no KV-cache method"),
    "awq": ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "no KV-cache method"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "cannot load bitsandbytes"),
    "mxfp4": ({"quant_method": "mxfp4"}, "not implemented"),
    "fbgemm_fp8": ({"quant_method": "fbgemm_fp8"}, "no KV-cache method"),
    "experts_int8": ({"quant_method": "experts_int8"}, "no warning at all"),
    "gguf": ({"quant_method": "gguf"}, "cannot load GGUF"),
    "quark": ({"quant_method": "quark", "kv_cache_group": ["*k_proj", "*v_proj"]}, "Quark"),
    "unknown": ({"quant_method": "hqq"}, "does not know"),
}
FP8_RELEASE = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def config_only(directory, quant: dict | None):
    """A checkpoint holding a config.json and nothing else: a refusal it gets comes before any weights could load."""
    import json

    directory.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    if quant is not None:
        config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_quant_methods_table_covers_every_row():
    from calibrate.vllm_facts.loaders import QUANT_METHODS

    for method, (form, why) in QUANT_METHODS.items():
        assert (form is None) != (why is None), method  # a form to write into, or the reason for refusing
        assert form in (None, "compressed-tensors", "modelopt", "fp8")
    assert {m for m, (form, _) in QUANT_METHODS.items() if form} == {None, "compressed-tensors", "modelopt", "fp8"}


@pytest.mark.parametrize("name", list(REFUSED))
def test_calibrate_refuses_a_source_whose_scales_vllm_would_not_read_before_loading(tmp_path, text_file, name):
    quant, fragment = REFUSED[name]
    source = config_only(tmp_path / "src", quant)  # no tokenizer, no weights: the check must come first
    with pytest.raises(ValueError, match=fragment) as e:
        calibrate(str(source), [str(text_file)], str(tmp_path / "out"), seq_len=64, max_tokens=192, progress=False,
                  verify=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


# vLLM's words when its base KV loader (a scalar per layer) meets per-head scales, as every refusal of them quotes.
SCALAR_WEIGHT = (r"'KV-cache scale expects a scalar weight' \(vLLM quantization/kv_cache\.py:34-40: per-head scales are "
                 r"compressed-tensors only\)")


def per_head_refused(directory, name: str) -> str:
    """The one sentence refusing per-head scales for a source whose loader takes a scalar, as a full-match regex."""
    return (rf"^{re.escape(str(directory))} is a {re.escape(name)} checkpoint, whose vLLM loader takes one scalar KV "
            rf"scale per layer: vLLM refuses per-head scales with {SCALAR_WEIGHT}; use --granularity tensor \(or token\)$")


@pytest.mark.parametrize("quant, name", [(FP8_RELEASE, "quant_method fp8"),
                                         ({"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"}, "ModelOpt")],
                         ids=["fp8", "modelopt_fp4"])
def test_calibrate_refuses_per_head_scales_for_a_scalar_loader_before_loading(tmp_path, text_file, quant, name):
    source = config_only(tmp_path / "src", quant)
    with pytest.raises(ValueError, match=per_head_refused(source, name)):
        calibrate(str(source), [str(text_file)], str(tmp_path / "out"), seq_len=64, max_tokens=192, granularity="head",
                  progress=False, verify=False)


def test_source_form_of_each_writable_method(tmp_path):
    from calibrate.checkpoint.loaders import source_form

    forms = {"none": (None, "compressed-tensors"), "fp8": (FP8_RELEASE, "fp8"),
             "nvfp4": ({"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"}, "modelopt"),
             "ct": ({"quant_method": "compressed-tensors", "config_groups": {}}, "compressed-tensors")}
    for name, (quant, form) in forms.items():
        directory = config_only(tmp_path / name, quant)
        assert source_form(directory, __import__("json").loads((directory / "config.json").read_text())) == form


@pytest.mark.parametrize("name", ["gptq", "mxfp4", "quark"])
def test_export_and_apply_refuse_the_same_sources(tmp_path, smol_tokenizer, text_file, name):
    from calibrate import export

    source = save_tiny_checkpoint(tmp_path / "model", "llama", smol_tokenizer, seed=0)
    out = calibrate(str(source), [str(text_file)], str(tmp_path / "ct"), seq_len=64, max_tokens=192, progress=False,
                    verify=False).out
    target = config_only(tmp_path / "target", REFUSED[name][0])
    with pytest.raises(ValueError, match=REFUSED[name][1]):
        apply(str(out), str(target), str(tmp_path / "applied"))
    with pytest.raises(ValueError, match=REFUSED[name][1]):
        export(str(out), str(tmp_path / "exported"), model=str(target))
    assert not (tmp_path / "applied").exists() and not (tmp_path / "exported").exists()


@pytest.mark.parametrize("form, granularity, name", [
    ("fp8", "head", "quant_method fp8"), ("modelopt", "head", "ModelOpt"), ("compressed-tensors", "head", None),
    ("fp8", "tensor", None), ("modelopt", "token", None),
])
def test_per_head_scales_are_refused_where_the_loader_takes_a_scalar(form, granularity, name):
    """One rule, one wording (loaders.check_scalar_scales) for calibrate, export, apply and the writer, whatever the form."""
    from calibrate.checkpoint.loaders import check_scalar_scales

    if name is None:
        check_scalar_scales("src", form, granularity)
        return
    with pytest.raises(ValueError, match=per_head_refused("src", name)):
        check_scalar_scales("src", form, granularity)


@pytest.mark.parametrize("method", ["fp8", "modelopt", "quark"])
def test_verify_refuses_per_head_scales_in_the_writers_words(method):
    """verify's refusal of a checkpoint's per-head scales (REFUSALS["head"]) quotes what check_scalar_scales quotes,
    for the same methods: those whose loader is vLLM's base KV method."""
    from calibrate.checkpoint.loaders import check_scalar_scales
    from calibrate.vllm_facts.loaders import BASE_PATH_METHODS

    why = refusal("head", Servable(method, False, False, "head"))
    assert re.fullmatch(f"not servable from this checkpoint: vLLM refuses it with {SCALAR_WEIGHT}", why), why
    with pytest.raises(ValueError, match=per_head_refused("src", BASE_PATH_METHODS[method])):
        check_scalar_scales("src", method, "head")
