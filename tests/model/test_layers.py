"""Hybrid and MoE decoders: kvcal captures K and V only where a layer has a KV cache, indexed as vLLM counts layers.

Each family is a tiny random model built here; the Q, K and V kvcal sees are compared with ones computed from the
attention module's own projections, norms, multipliers and RoPE (no attention interface involved).
"""

import pytest
import torch
import transformers as T
from references import reference_qkv

from calibrate.capture.hooks import run_capture
from calibrate.capture.stats import Stats
from calibrate.model.layers import attention_layers, signature, signature_of

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=4096)

# family → (config, the decoder layers that hold a KV cache: vLLM's --kv-cache-dtype-skip-layers indices)
FAMILIES = {
    # Qwen3-Next: three gated-DeltaNet (linear attention, no KV cache) layers to one full-attention layer, MoE MLPs
    "qwen3_next": (lambda: T.Qwen3NextConfig(
        **COMMON, num_hidden_layers=4, head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32), [3]),
    # Qwen3.5 (text part, dense and MoE): Qwen3-Next's layout, its RoPE on a quarter of each head (partial rotary)
    "qwen3_5_text": (lambda: T.Qwen3_5TextConfig(
        **COMMON, num_hidden_layers=4, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16), [1, 3]),
    "qwen3_5_moe_text": (lambda: T.Qwen3_5MoeTextConfig(
        **COMMON, num_hidden_layers=4, head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32), [3]),
    # Jamba: Mamba layers with an attention layer every second one (no RoPE), MoE every second layer
    "jamba": (lambda: T.JambaConfig(
        **COMMON, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False), [1, 3]),
    # Falcon-H1: attention and Mamba side by side in every layer; K scaled by key_multiplier before the cache
    "falcon_h1": (lambda: T.FalconH1Config(
        **COMMON, num_hidden_layers=3, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=16, key_multiplier=3.0), [0, 1, 2]),
    # gpt-oss: sliding and full layers in turn, attention sinks, MoE
    "gpt_oss": (lambda: T.GptOssConfig(
        **COMMON, num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2), [0, 1, 2, 3]),
    "qwen3_moe": (lambda: T.Qwen3MoeConfig(**COMMON, num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32), [0, 1, 2]),
    "mixtral": (lambda: T.MixtralConfig(**COMMON, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2), [0, 1, 2]),
}


def model_of(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(FAMILIES[family][0]()).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_only_layers_with_a_kv_cache_are_captured_as_they_are_computed(family):
    model = model_of(family)
    layers = attention_layers(model)
    cached = FAMILIES[family][1]
    assert [layer.layer_idx for layer in layers] == cached
    assert [layer.prefix for layer in layers] == [f"model.layers.{i}.self_attn" for i in cached]  # vLLM's index: the name's integer
    seqs = [torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    refs = [reference_qkv(model, s[None]) for s in seqs]
    assert sorted(refs[0]) == cached
    # Whole sequences: exactly the reference's values. Chunked prefill (16 tokens a chunk, through the cache, the
    # recurrent layers' state included): equal up to float32 summation order; a lost state would be far off.
    for chunk_len, rtol in ((4096, 0.0), (16, 1e-4)):
        stats = run_capture(model, layers, seqs, Stats.empty(signature(model, layers)), chunk_len=chunk_len, progress=False)
        for row, layer in enumerate(layers):
            for kind in ("q", "k", "v"):
                expected = torch.stack([r[layer.layer_idx][kind].abs().amax((0, 2, 3)) for r in refs]).amax(0)  # [H]
                torch.testing.assert_close(stats.kinds[kind].absmax[row], expected, rtol=rtol, atol=0,
                                           msg=f"{family} {kind} layer {layer.layer_idx}, chunks of {chunk_len}")
            assert int(stats.tokens[row]) == 120


def test_gpt_oss_sliding_layers_are_marked_for_skip_layers():
    layers = attention_layers(model_of("gpt_oss"))
    assert [layer.sliding_window for layer in layers] == [True, False, True, False]


@pytest.mark.parametrize("config", [
    {"model_type": "bloom", "n_head": 4, "hidden_size": 64},
    {"model_type": "mpt", "n_heads": 4, "d_model": 64},
    {"model_type": "gpt2", "n_head": 4, "n_embd": 64},
    {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64},
], ids=["bloom", "mpt", "gpt2", "llama"])
def test_signature_reads_the_head_count_however_the_family_names_it(config):
    sig = signature_of(config, [0, 1])
    assert (sig.num_heads, sig.num_kv_heads, sig.head_dim) == (4, 4, 16)
