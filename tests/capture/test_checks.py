"""calibrate/capture/checks.py: statistics on too few tokens, or holding NaN/Inf, refused before any scale; all-zero
layers warned about."""

import pytest
import torch

from calibrate.capture.checks import check_enough_tokens, check_finite
from calibrate.capture.stats import Stats
from calibrate.config import CalibrationConfig
from calibrate.data.config import DataConfig
from calibrate.model.layers import AttentionLayer, ModelSignature

SIG = ModelSignature("llama", [0, 1, 2], num_kv_heads=2, num_heads=4, head_dim=8)
LAYERS = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in SIG.layers]


def run_config(seq_len=64, max_tokens=512, min_tokens=None, pack=True) -> CalibrationConfig:
    data = DataConfig(["data.jsonl"], seq_len=seq_len, max_tokens=max_tokens, pack=pack)
    return CalibrationConfig(model="m", data=data, out="o", min_tokens=min_tokens)


def stats_with_tokens(tokens: list[int]) -> Stats:
    stats = Stats.empty(SIG)
    stats.tokens = torch.tensor(tokens)
    return stats


@pytest.mark.parametrize("tokens, seq_len, max_tokens, min_tokens, pack, message", [
    ([64, 64, 64], 64, 512, None, True, None),
    ([30, 64, 64], 64, 512, None, True, r"gave 30 tokens per layer, fewer than the 64 needed \(one --seq-len 64 sequence\).*--min-tokens 30 "),
    ([32, 32, 32], 64, 32, None, False, None),
    ([100, 100, 100], 64, 512, 200, True, r"fewer than the 200 needed \(--min-tokens 200\).*pass --min-tokens 100 to accept"),
    ([200, 200, 200], 64, 512, 200, True, None),
    ([0, 0, 0], 64, 512, None, True, r"gave 0 tokens .*pass --min-tokens 1 to accept"),
], ids=["one-sequence", "fewest-layer-short", "budget-below-seq-len", "below-min-tokens", "min-tokens-met", "no-tokens"])
def test_check_enough_tokens(tokens, seq_len, max_tokens, min_tokens, pack, message):
    """The fewest tokens any layer saw must reach --min-tokens, else one full sequence (or the whole budget)."""
    config, stats = run_config(seq_len, max_tokens, min_tokens, pack), stats_with_tokens(tokens)
    if message is None:
        check_enough_tokens(stats, config)
    else:
        with pytest.raises(ValueError, match=message):
            check_enough_tokens(stats, config)


def test_check_finite_names_the_layer_with_nan_and_warns_on_all_zero():
    stats = Stats.empty(SIG)
    stats.kinds["k"].absmax[:] = 1.0
    stats.kinds["v"].absmax[:] = 1.0
    stats.kinds["q"].absmax[:] = 1.0
    check_finite(stats, LAYERS)  # finite, nowhere zero: silent

    stats.kinds["v"].absmax[2] = 0.0
    with pytest.warns(UserWarning, match="v is all zero in model.layers.2.self_attn; writing the floor scale"):
        check_finite(stats, LAYERS)
    stats.kinds["k"].nonfinite[1, 0] = 3
    with pytest.raises(ValueError, match=r"k holds NaN or Inf in model\.layers\.1\.self_attn;.*--dtype float32"):
        check_finite(stats, LAYERS)
