"""capture/hooks.py: kvcal sees exactly the Q, K and V that vLLM caches, for every decoder family."""


import pytest
import torch
from builders import FAMILIES, tiny_model
from references import reference_qkv

from calibrate.capture.hooks import hooked_attention, run_capture
from calibrate.capture.stats import Stats
from calibrate.model.layers import attention_layers, signature


@pytest.mark.parametrize("family", FAMILIES)
def test_absmax_per_head_matches_independent_computation(family):
    model = tiny_model(family)
    layers = attention_layers(model)
    seqs = [torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    stats = run_capture(model, layers, seqs, Stats.empty(signature(model, layers)), chunk_len=4096, progress=False)

    refs = [reference_qkv(model, s.unsqueeze(0)) for s in seqs]
    assert [layer.layer_idx for layer in layers] == sorted(refs[0])
    for row, layer in enumerate(layers):
        for kind in ("q", "k", "v"):
            expected = torch.stack([r[layer.layer_idx][kind].abs().amax((0, 2, 3)) for r in refs]).amax(0)  # [H]
            torch.testing.assert_close(stats.kinds[kind].absmax[row], expected, rtol=0, atol=0, msg=f"{family} {kind} layer {row}")
            total = sum(float(r[layer.layer_idx][kind].double().square().sum()) for r in refs)
            assert float(stats.kinds[kind].sumsq[row].sum()) == pytest.approx(total, rel=1e-6)  # per-token sums are float32
        assert int(stats.tokens[row]) == 120
    # GQA: K/V stats per KV head, Q per query head.
    assert stats.kinds["k"].absmax.shape == (3, 2) and stats.kinds["q"].absmax.shape == (3, 4)
    assert model.config._attn_implementation != "kvcal" and not model.config._attn_implementation.startswith("kvcal_")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_chunked_prefill_observes_each_position_once(family):
    model = tiny_model(family)
    layers = attention_layers(model)
    seqs = [torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(7))]
    whole = run_capture(model, layers, seqs, Stats.empty(signature(model, layers)), chunk_len=4096, progress=False)
    chunked = run_capture(model, layers, seqs, Stats.empty(signature(model, layers)), chunk_len=16, progress=False)
    torch.testing.assert_close(chunked.tokens, whole.tokens, rtol=0, atol=0)
    torch.testing.assert_close(chunked.pos_tokens, whole.pos_tokens, rtol=0, atol=0)
    for kind in ("q", "k", "v"):
        a, b = whole.kinds[kind], chunked.kinds[kind]
        # Layer 0 sees the same inputs bit for bit; deeper layers differ only by float rounding of attention.
        torch.testing.assert_close(b.hist[0], a.hist[0], rtol=0, atol=0)
        torch.testing.assert_close(b.absmax, a.absmax, rtol=1e-5, atol=1e-6)
        assert (b.hist - a.hist).abs().sum() <= 0.002 * a.hist.sum()
        torch.testing.assert_close(b.pos_absmax, a.pos_absmax, rtol=1e-5, atol=1e-6)


@pytest.mark.smoke
def test_positions_follow_the_cache_in_chunked_prefill():
    model = tiny_model("llama")
    layers = attention_layers(model)
    seen = []

    def hook(module, q, k, v, mask, base, **kwargs):
        if module.layer_idx == 0:
            seen.append(kwargs["position_ids"].flatten().tolist())
        return base(module, q, k, v, mask, **kwargs)

    from calibrate.capture.hooks import forward_chunked

    with hooked_attention(model, hook):
        forward_chunked(model, torch.arange(10).unsqueeze(0), chunk_len=4)
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    del layers


@pytest.mark.smoke
def test_hook_is_removed_after_an_error():
    model = tiny_model("llama")

    def failing(module, q, k, v, mask, base, **kwargs):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), hooked_attention(model, failing):
        model(input_ids=torch.arange(5).unsqueeze(0))
    assert model.config._attn_implementation == "sdpa"
    model(input_ids=torch.arange(5).unsqueeze(0))  # runs normally again


def test_layers_that_see_nothing_are_an_error_not_a_scale():
    model = tiny_model("llama")
    layers = attention_layers(model)
    stats = Stats.empty(signature(model, layers))
    with pytest.raises(ValueError, match="no attention call reached"):
        run_capture(model, layers, [], stats, chunk_len=64, progress=False)

    # A layer whose attention bypasses the interface: replace layer 1's forward with one that never calls it.
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn"):
        run_capture(model, layers, [torch.arange(8)], Stats.empty(signature(model, layers)), chunk_len=64, progress=False)


def test_a_non_finite_activation_stops_the_capture_at_its_sequence():
    """The last layer's V turns to Inf on the second sequence (the last, so no later layer inherits it): the capture
    refuses there, naming that layer, without reading the rest."""
    model = tiny_model("llama")
    layers = attention_layers(model)
    calls = []

    def overflow(module, args, output):
        calls.append(1)
        return output * float("inf") if len(calls) == 2 else output

    last = len(layers) - 1
    model.model.layers[last].self_attn.v_proj.register_forward_hook(overflow)
    read = []
    sequences = (read.append(i) or torch.arange(8) + i for i in range(5))
    with pytest.raises(ValueError, match=rf"^v holds NaN or Inf in model\.layers\.{last}\.self_attn;.*--dtype float32"):
        run_capture(model, layers, sequences, Stats.empty(signature(model, layers)), chunk_len=64, progress=False)
    assert read == [0, 1]
