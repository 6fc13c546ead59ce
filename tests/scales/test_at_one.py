"""Tests for calibrate/scales/at_one.py: what scale 1.0 would clip, from the statistics alone.

The counts are checked against values counted directly in float64: synthetic tensors put through ``Stats.update``, and
the K a tiny Qwen2 model really caches (its ``past_key_values``, after RoPE, the K vLLM would store) on the
calibration's own sequences. A large k_proj bias (Qwen2's k_proj has one) makes K exceed 448 in chosen layers
(``builders.biased_qwen2``, the conftest fixture ``clipping_qwen2``).
"""

import json

import pytest
import torch
from builders import BIASED_LAYERS
from transformers import AutoModelForCausalLM

from calibrate import calibrate
from calibrate.capture.stats import Stats
from calibrate.checkpoint.inspect import inspect
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
from calibrate.fp8 import FORMATS
from calibrate.model.layers import ModelSignature
from calibrate.scales.at_one import at_one_line, at_scale_one

E4M3 = FORMATS["e4m3fn"]


def synthetic_stats(values: dict[str, torch.Tensor]) -> Stats:
    """Statistics of kind → [L, B, H, S, D] values, put through Stats.update layer by layer."""
    L, _, hkv, S, D = values["k"].shape
    sig = ModelSignature("llama", list(range(L)), num_kv_heads=hkv, num_heads=values["q"].shape[2], head_dim=D)
    stats = Stats.empty(sig)
    positions = torch.arange(S).expand(values["k"].shape[1], S)
    for row in range(L):
        stats.update(row, values["q"][row], values["k"][row], values["v"][row], positions)
    return stats


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_counts_at_or_above_the_format_s_largest_value_exactly(fmt):
    """Values just below, exactly at, inside the bin above and far beyond the largest value: the histogram's count
    is the direct count, to the element (the largest value is a bin edge)."""
    fmt = FORMATS[fmt]
    torch.manual_seed(0)
    values = {kind: torch.randn(3, 2, heads, 16, 8) * 40 for kind, heads in (("k", 2), ("v", 2), ("q", 4))}
    k = values["k"]
    k[0, 0, 0, 0, :4] = torch.tensor([fmt.max, -fmt.max, fmt.max * 1.01, torch.nextafter(torch.tensor(fmt.max), torch.tensor(0.0))])
    k[2, 1, 1, 3, 0] = -7 * fmt.max
    found = at_scale_one(synthetic_stats(values), fmt)
    for kind, x in values.items():
        reference = (x.double().abs() >= fmt.max).flatten(1).sum(1) / x[0].numel()  # [L], counted directly
        assert found[kind].beyond == reference.tolist()
        assert found[kind].absmax == x.abs().flatten(1).amax(1).tolist()
    assert found["k"].clipped(fmt) == [0, 2] and found["v"].clipped(fmt) == [] == found["q"].clipped(fmt)


def test_the_line_names_what_clips_or_that_nothing_reaches_the_range():
    torch.manual_seed(1)
    values = {kind: torch.randn(4, 1, heads, 8, 8) for kind, heads in (("k", 2), ("v", 2), ("q", 4))}
    quiet = at_one_line(at_scale_one(synthetic_stats(values), E4M3), E4M3)
    assert quiet.startswith("no K, V or Q value reaches FP8 e4m3fn's largest value 448 at scale 1.0 (largest absmax ")
    assert quiet.endswith("verify tells whether the calibrated scales still help")
    values["k"][1, 0, 0, 0, 0] = 2983.0
    values["k"][3, 0, 1, 2, 5] = -900.0
    values["q"][0, 0, 3, 1, 1] = 449.0
    loud = at_one_line(at_scale_one(synthetic_stats(values), E4M3), E4M3)
    assert loud.startswith("scale 1.0 would clip K in 2 of 4 layers (absmax up to 2,983 > 448; worst layer 0.781% of values")
    assert "Q in 1 of 4 layers (absmax up to 449 > 448" in loud and "V in" not in loud
    assert loud.endswith(": serve the calibrated scales")


def cached_keys(model_dir, sequences) -> torch.Tensor:
    """K as the model caches it (after RoPE) for each sequence, float64: [L, N, Hkv, S, D] stacked over sequences."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    per_sequence = []
    with torch.no_grad():
        for ids in sequences:
            cache = model(ids[None], use_cache=True).past_key_values
            per_sequence.append(torch.stack([layer.keys[0].double() for layer in cache.layers]))  # [L, Hkv, S, D]
    return torch.stack(per_sequence, 1)


def test_calibrate_says_scale_1_clips_k_where_the_cached_keys_exceed_448(clipping_qwen2, smol_tokenizer, text_file, tmp_path):
    out = tmp_path / "out"
    result = calibrate(str(clipping_qwen2), [str(text_file)], str(out), seq_len=64, max_tokens=128, progress=False, verify=False)
    assert json.loads((out / "kvcal" / "calibration.json").read_text())["dtype"] == "float32"  # as the reference runs
    sequences = list(iter_sequences(DataConfig(sources=[str(text_file)], seq_len=64, max_tokens=128), smol_tokenizer))
    keys = cached_keys(clipping_qwen2, sequences)  # [L, N, Hkv, S, D]
    beyond = (keys.abs() >= 448).flatten(1).double().mean(1)  # [L], counted directly
    clipped = [layer for layer in range(keys.shape[0]) if keys[layer].abs().max() > 448]
    assert clipped == list(BIASED_LAYERS)

    at_one = json.loads((out / "kvcal" / "calibration.json").read_text())["at_scale_1"]
    assert at_one["k"]["clipped_layers"] == clipped and at_one["v"]["clipped_layers"] == []
    assert at_one["k"]["fraction_at_or_above_max"] == pytest.approx(beyond.tolist(), abs=1e-9)
    assert at_one["k"]["absmax"] == pytest.approx(keys.abs().flatten(1).amax(1).tolist(), rel=1e-6)
    line = at_one["line"]
    assert line.startswith(f"scale 1.0 would clip K in 2 of 3 layers (absmax up to {keys.abs().max():,.4g} > 448")
    lines = result.summary().splitlines()
    assert lines[lines.index(line) + 1] == f"wrote {out}"  # among the last lines: after the table, before the serve line
    assert line in (out / "README.md").read_text()
    assert f"kvcal's statistics: {line}" in inspect(str(out)).notes


def test_a_model_whose_values_stay_small_says_nothing_reaches_the_range(tiny_dir, text_file, tmp_path):
    out = tmp_path / "out"
    result = calibrate(str(tiny_dir), [str(text_file)], str(out), seq_len=64, max_tokens=128, progress=False, verify=False)
    line = json.loads((out / "kvcal" / "calibration.json").read_text())["at_scale_1"]["line"]
    largest = max(float(result.stats.kinds[kind].absmax.max()) for kind in ("k", "v", "q"))
    assert largest < 448
    assert line == (f"no K, V or Q value reaches FP8 e4m3fn's largest value 448 at scale 1.0 (largest absmax "
                    f"{largest:,.4g}): verify tells whether the calibrated scales still help")
    assert line in result.summary() and line in (out / "README.md").read_text()
    assert f"kvcal's statistics: {line}" in inspect(str(out)).notes
