"""Multimodal checkpoints (Gemma 3, Qwen2.5-VL, Llama 4, Mistral 3): text-only calibration of the language model, scales under the
checkpoint's own tensor names, the vision tower left alone.

transformers 5 renames these families' modules on load (``model.language_model.layers.N``) and back on save
(Gemma 3, Llama 4, Mistral 3: ``language_model.model.layers.N``; Qwen2.5-VL: ``model.layers.N``). vLLM READ_IN reads the
saved spelling (its Llama 4 builds its language model as ``language_model.model``; gemma3_mm.py, qwen2_5_vl.py and
mistral3.py also map the new one in ``hf_to_vllm_mapper``); kvcal writes the checkpoint's own, beside its weights.
"""

import pytest
import torch
import transformers as T
from references import reference_qkv
from safetensors import safe_open

from calibrate import calibrate, verify
from calibrate.capture.hooks import run_capture
from calibrate.capture.stats import Stats
from calibrate.model.directory import checkpoint_prefixes, tensor_names, vllm_files
from calibrate.model.layers import attention_layers, signature

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "gemma3": (lambda V: T.Gemma3Config(
        text_config=dict(TEXT, vocab_size=V, head_dim=16, sliding_window=8),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                           patch_size=14), mm_tokens_per_image=4), "language_model.model.layers.{}.self_attn"),
    "qwen2_5_vl": (lambda V: T.Qwen2_5_VLConfig(
        text_config=dict(TEXT, vocab_size=V, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)), "model.layers.{}.self_attn"),
    # Llama 4: MoE text model with chunked attention and RoPE-free layers; its vision encoder's layers are named
    # vision_model.model.layers.N.self_attn, which must not be taken for the decoder's
    "llama4": (lambda V: T.Llama4Config(
        text_config=dict(TEXT, vocab_size=V, head_dim=16, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                         interleave_moe_layer_step=1, no_rope_layers=[1, 0], attention_chunk_size=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                           patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)),
        "language_model.model.layers.{}.self_attn"),
    "mistral3": (lambda V: T.Mistral3Config(
        text_config=dict(TEXT, model_type="mistral", vocab_size=V, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                           patch_size=14, head_dim=16)), "language_model.model.layers.{}.self_attn"),
}


def tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in vllm_files(directory)[0]:
        with safe_open(str(path), "pt") as f:
            out |= {name: f.get_tensor(name) for name in tensor_names(path)}
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_multimodal_scales_go_under_the_checkpoint_names_and_the_vision_tower_is_untouched(family, smol_tokenizer, kjv_path, tmp_path):
    config, names = FAMILIES[family]
    torch.manual_seed(0)
    model = T.AutoModelForImageTextToText.from_config(config(len(smol_tokenizer))).eval()
    model.save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    assert checkpoint_prefixes(tmp_path / "model") == {i: names.format(i) for i in range(2)}
    result = calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "out"), seq_len=64, max_tokens=256,
                       progress=False, verify=False)
    assert [layer.prefix for layer in result.layers] == [names.format(i) for i in range(2)]
    source, written = tensors(tmp_path / "model"), tensors(result.out)
    scales = {name for name in written if name.endswith(("k_scale", "v_scale", "q_scale"))}
    assert scales == {f"{names.format(i)}.{k}_scale" for i in range(2) for k in "kvq"}
    assert set(written) - scales == set(source)  # nothing renamed, nothing added but the scales
    for name, tensor in source.items():  # the vision tower and every other weight as they were
        assert torch.equal(written[name], tensor), name
    # verify finds the scales where they were written
    report = verify(result.out, [str(kjv_path)], seq_len=64, max_tokens=128, schemes="tensor", progress=False, probe_layers=0).report
    assert report["schemes"]["tensor"]["source"] == "checkpoint"

    if family == "gemma3":  # text-only data runs through the language model: K per layer as the module computes it
        ids = torch.randint(0, len(smol_tokenizer), (1, 40), generator=torch.Generator().manual_seed(1))
        ref = reference_qkv(model, ids)
        assert sorted(ref) == [0, 1]  # the vision tower's attention has no layer index: not a KV-cache layer
        layers = attention_layers(model)
        stats = run_capture(model, layers, [ids[0]], Stats.empty(signature(model, layers)), chunk_len=4096, progress=False)
        for row in range(2):
            for kind in "qkv":
                torch.testing.assert_close(stats.kinds[kind].absmax[row], ref[row][kind].abs().amax((0, 2, 3)), rtol=0, atol=0)


def test_a_multimodal_checkpoint_without_its_language_model_is_refused(smol_tokenizer, kjv_path, tmp_path, capsys):
    from runners import assert_refused, kvcal
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    T.AutoModelForImageTextToText.from_config(FAMILIES["gemma3"][0](len(smol_tokenizer))).save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("language_model.")}, weights, metadata={"format": "pt"})
    capsys.readouterr()  # the save's own progress output
    code, err = kvcal(capsys, "calibrate", str(tmp_path / "model"), "--data", str(kjv_path), "--seq-len", "64",
                      "--max-tokens", "256", "--out", str(tmp_path / "out"), "--no-verify", "--quiet")
    assert_refused(code, err, "parameters missing", "language_model", "kvcal inspect")
    assert not (tmp_path / "out").exists()
