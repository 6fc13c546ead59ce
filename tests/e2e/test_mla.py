"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3, Kimi-K2's shape of V3): kvcal sees what vLLM caches.

vLLM caches per token the normalised latent kv_c_normed and the RoPE'd k_pe under one k scale, and (with an FP8
cache on the backends that take a quantized query) quantizes the absorbed query [q_nope · W_UK | q_pe] with q_scale.
The reference here is computed in float64 from a forward pre-hook's hidden states with the module's own weights and
its config's RoPE frequencies, rotating pairs of channels as vLLM does (GPT-J style): no transformers attention code.
"""

import pytest
import torch
import transformers as T
from references import forward_with_attention_pre_hook

from calibrate.capture.hooks import run_capture
from calibrate.capture.stats import Stats
from calibrate.checkpoint.write import stored_scales
from calibrate.fp8 import get_format
from calibrate.model.layers import attention_layers, signature
from calibrate.scales.observers import derive_scales
from calibrate.vllm_facts.release import READ_IN

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=4096, num_hidden_layers=3)
MOE = dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
           first_k_dense_replace=1, n_group=1, topk_group=1)
FAMILIES = {
    "deepseek_v2": lambda: T.DeepseekV2Config(**COMMON, **MOE, num_attention_heads=4, num_key_value_heads=4,
                                              kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                              qk_nope_head_dim=16, v_head_dim=16),
    "deepseek_v3": lambda: T.DeepseekV3Config(**COMMON, **MOE, num_attention_heads=4, num_key_value_heads=4,
                                              kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                              qk_nope_head_dim=16, v_head_dim=16),
    # Kimi-K2 is DeepSeek-V3's architecture with a low-rank query, more latent than RoPE, fewer heads per latent width
    "kimi_k2": lambda: T.DeepseekV3Config(**COMMON, **MOE, num_attention_heads=8, num_key_value_heads=8,
                                          kv_lora_rank=48, q_lora_rank=24, qk_rope_head_dim=8,
                                          qk_nope_head_dim=32, v_head_dim=16),
}


def model_of(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():  # random RMSNorm weights: a latent norm of ones would hide a missing or doubled norm
        for module in model.modules():
            if isinstance(getattr(module, "weight", None), torch.nn.Parameter) and "RMSNorm" in type(module).__name__:
                module.weight.uniform_(0.5, 3.0)
    return model


def rope_gptj(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [..., S, R] by positions × inv_freq[i], in float64 (vLLM's is_neox_style=False)."""
    angle = positions.double()[:, None] * inv_freq.double()[None]  # [S, R/2]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def reference_latent(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer, float64: kv_c_normed [S, L], k_pe [S, R] and the absorbed query [H, S, L + R] of input_ids [1, S]."""
    cfg = model.config
    R, L, nope = cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    positions = torch.arange(input_ids.shape[1])
    out = {}

    def rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return x * (x.square().mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt() * norm.weight.double()

    def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        return x @ layer.weight.double().T + (layer.bias.double() if layer.bias is not None else 0)

    def pre_hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)[0].double()  # [S, hidden]
        compressed = linear(h, module.kv_a_proj_with_mqa)
        latent = rms(compressed[:, :L], module.kv_a_layernorm)
        k_pe = rope_gptj(compressed[:, L:], positions, inv_freq)
        if module.q_lora_rank is None:
            q = linear(h, module.q_proj)
        else:
            q = linear(rms(linear(h, module.q_a_proj), module.q_a_layernorm), module.q_b_proj)
        q = q.view(h.shape[0], -1, nope + R).transpose(0, 1)  # [H, S, nope + R]
        w_uk = module.kv_b_proj.weight.double().view(q.shape[0], -1, L)[:, :nope]  # [H, nope, L]
        absorbed = torch.cat([q[..., :nope] @ w_uk, rope_gptj(q[..., nope:], positions, inv_freq)], dim=-1)
        out[module.layer_idx] = {"latent": latent, "k_pe": k_pe, "q": absorbed}

    forward_with_attention_pre_hook(model, input_ids, pre_hook)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_mla_captures_the_latent_k_pe_and_absorbed_query_vllm_sees(family):
    model = model_of(family)
    cfg = model.config
    layers = attention_layers(model)
    sig = signature(model, layers)
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert (sig.num_kv_heads, sig.head_dim, sig.latent_dim, sig.num_heads) == (1, L + R, L, cfg.num_attention_heads)
    seqs = [torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    refs = [reference_latent(model, s[None]) for s in seqs]
    for chunk_len in (4096, 16):  # whole sequences, and chunked prefill through the latent cache
        stats = run_capture(model, layers, seqs, Stats.empty(sig), chunk_len=chunk_len, progress=False)
        for row, layer in enumerate(layers):
            ref_latent = torch.stack([r[layer.layer_idx]["latent"].abs().amax(0) for r in refs]).amax(0)  # [L]
            ref_pe = torch.stack([r[layer.layer_idx]["k_pe"].abs().amax(0) for r in refs]).amax(0)  # [R]
            for kind in ("k", "v"):  # the latent is both K and V; vLLM's layout: latent channels, then k_pe's
                channels = stats.kinds[kind].channel_absmax[row, 0].double()
                torch.testing.assert_close(channels[:L], ref_latent, rtol=1e-5, atol=1e-6)
                # transformers keeps V3's interleaved RoPE channels in halves order: compare k_pe's channels as a set
                torch.testing.assert_close(channels[L:].sort().values, ref_pe.sort().values, rtol=1e-5, atol=1e-6)
            ref_q = torch.stack([r[layer.layer_idx]["q"].abs().amax((1, 2)) for r in refs]).amax(0)  # [H]
            torch.testing.assert_close(stats.kinds["q"].absmax[row].double(), ref_q, rtol=1e-5, atol=1e-6)
            assert int(stats.tokens[row]) == 120

    # The k scale covers both parts: max(|kv_c_normed|, |k_pe|) / 448, never the latent alone.
    scales = stored_scales(derive_scales(stats.kinds, fmt=get_format("e4m3fn"), observer="max", granularity="tensor"))
    for row, layer in enumerate(layers):
        both = max(float(torch.cat([r[layer.layer_idx][p].flatten() for r in refs]).abs().max()) for p in ("latent", "k_pe"))
        assert float(scales["k"][row]) == pytest.approx(both / 448, rel=1e-5)


def test_mla_model_without_expand_kv_is_refused(monkeypatch):
    model = model_of("deepseek_v3")
    monkeypatch.delattr(T.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention, "expand_kv")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn .*deepseek_v3.*MLA latent.*expand_kv"):
        attention_layers(model)


class QuantizingCache(T.DynamicCache):
    """A KV cache that stores what an FP8 e4m3 cache would hold: transformers' MLA writes (kv_c_normed, k_pe) here."""

    def __init__(self, scales: list[float], **kwargs):
        super().__init__(**kwargs)
        self.scales = scales

    def update(self, kv_c, k_pe, layer_idx, *args, **kwargs):
        s = self.scales[layer_idx]
        q = [(x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(s).to(x.dtype) for x in (kv_c, k_pe)]
        return super().update(*q, layer_idx, *args, **kwargs)


def test_verify_quantizes_the_latent_as_a_cache_holding_fp8_would():
    from calibrate.capture.hooks import prefill_chunks
    from calibrate.verification.passes import ApplyScheme
    from calibrate.verification.schemes import Mode, Scheme

    model = model_of("deepseek_v3")
    layers = attention_layers(model)
    scales = [0.004, 0.006, 0.005]  # small enough that a few latent values saturate, as well as rounding
    scheme = Scheme("t", Mode.STATIC, "test", get_format("e4m3fn"), "tensor", {k: torch.tensor(scales)[:, None] for k in "kv"})
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    hooked = torch.cat(list(prefill_chunks(model, ids, 64, hook=ApplyScheme(scheme, {a.layer_idx: r for r, a in enumerate(layers)}), keep_from=0)))
    with torch.no_grad():
        expected = model(input_ids=ids, cache=QuantizingCache(scales, config=model.config), use_cache=True).logits[0]
        plain = model(input_ids=ids).logits[0]
    torch.testing.assert_close(hooked, expected, rtol=1e-5, atol=1e-5)
    assert (plain - expected).abs().max() > 1e-3  # the quantization is visible: the comparison can fail


def test_verify_runs_on_an_mla_checkpoint(smol_tokenizer, kjv_path, tmp_path):
    from calibrate import calibrate, verify

    torch.manual_seed(0)
    config = T.DeepseekV3Config(**COMMON | {"vocab_size": len(smol_tokenizer)}, **MOE, num_attention_heads=4,
                                num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                qk_nope_head_dim=16, v_head_dim=16)
    model = T.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    with pytest.warns(UserWarning, match="MLA layers"):
        out = calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "out"), seq_len=64, max_tokens=512,
                        progress=False, verify=False).out
    with pytest.raises(ValueError, match="latent attention.*--granularity tensor"):
        calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "out2"), seq_len=64, max_tokens=512,
                  granularity="head", progress=False, verify=False)
    report = verify(out, [str(kjv_path)], seq_len=128, max_tokens=256, chunk_len=64, device="cpu",
                    schemes="tensor,token,int8_per_token_head,head", progress=False).report
    assert set(report["schemes"]) == {"tensor", "scale1"}  # scale1: what vLLM READ_IN serves for MLA
    assert set(report["skipped"]) == {"token", "int8_per_token_head", "head"}
    assert report["recommendation"][0].startswith(f"vLLM {READ_IN} loads no checkpoint KV scales into MLA layers")
    for name in ("tensor", "scale1"):
        r = report["schemes"][name]
        assert 0 < r["kl"] < 1 and r["bytes_per_token"] == 3 * (32 + 16)  # fp8: one byte per latent element, no V
        assert r["bytes_vs_bf16"] == 0.5
        assert r["quantizes_query"] and set(r["fractions"]) == {"k", "v", "q"}  # the absorbed query, counted
        assert all(0 < e < 1 for e in r["layer_rel_error"])
    kv_only = verify(out, [str(kjv_path)], seq_len=128, max_tokens=256, chunk_len=64, device="cpu", schemes="tensor",
                     kv_only=True, progress=False).report["schemes"]["tensor"]
    assert set(kv_only["fractions"]) == {"k", "v"} and kv_only["kl"] != report["schemes"]["tensor"]["kl"]


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2"])
def test_absorbed_attention_is_the_models_own_attention(family):
    """vLLM's decode form (absorbed query against the latent row, then W_UV) computes the model's attention: with the
    query left as it is, the logits are the model's own; quantizing the absorbed query changes them."""
    from calibrate.capture.hooks import cached_latent, prefill_chunks
    from calibrate.verification.schemes import absorbed_attention

    model = model_of(family)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))

    def hook(quantize):
        def call(module, query, key, value, attention_mask, base_attention, **kwargs):
            return absorbed_attention(module, query, *cached_latent(module), quantize, attention_mask, base_attention, **kwargs)
        return call

    for chunk_len in (64, 16):
        own = torch.cat(list(prefill_chunks(model, ids, chunk_len, keep_from=0)))
        absorbed = torch.cat(list(prefill_chunks(model, ids, chunk_len, hook=hook(lambda q: q), keep_from=0)))
        torch.testing.assert_close(absorbed, own, rtol=1e-4, atol=1e-4)
    coarse = torch.cat(list(prefill_chunks(model, ids, 64, hook=hook(lambda q: (q * 4).round() / 4), keep_from=0)))
    assert (coarse - own).abs().max() > 1e-3


def test_an_mla_config_with_an_unexpected_latent_layout_is_refused(kjv_path, tmp_path, capsys):
    import json

    from runners import assert_refused, kvcal

    model_of("deepseek_v3").save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps(config | {"kv_lora_rank": 0}))
    capsys.readouterr()
    code, err = kvcal(capsys, "calibrate", str(tmp_path / "model"), "--data", str(kjv_path), "--out", str(tmp_path / "out"))
    assert_refused(code, err, "kv_lora_rank 0", "positive kv_lora_rank")
    assert not (tmp_path / "out").exists()


def test_the_deepseek_recipe_fits_mla_models_and_compares_with_vllm_s_scale_one(smol_tokenizer, kjv_path, tmp_path):
    from calibrate import calibrate, recipes

    config = FAMILIES["kimi_k2"]()
    config.vocab_size = len(smol_tokenizer)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    with pytest.warns(UserWarning, match="MLA layers"):
        result = calibrate(str(tmp_path / "model"), [str(kjv_path)], str(tmp_path / "out"), recipe="deepseek", seq_len=64,
                           max_tokens=512, progress=False)
    assert result.provenance["recipe"]["name"] == "deepseek"
    assert set(result.verification.report["schemes"]) == {"tensor", "scale1"}
    assert any(line.startswith(f"recipe deepseek: vLLM {READ_IN} loads no KV scale into MLA layers")
               for line in recipes.serve_notes(result.provenance["recipe"]))
