"""Tests for calibrate/checkpoint/scale_check.py: scales that lie are caught, by ``kvcal inspect`` here (verify's use of
the same check is in tests/verification/test_run.py).

The checkpoints are a real kvcal output of a tiny model, edited the way the field's bugs leave them: every scale 0
(llm-compressor's form), every scale 1.0 in ModelOpt's form (``fp8_cast``), one absurd scale, one negative scale.
"""

import json
import shutil

import pytest
import torch
from builders import edited_scales, save_tiny_checkpoint
from runners import QUIET
from safetensors.torch import load_file, save_file

from calibrate import api
from calibrate.capture.stats import Stats
from calibrate.checkpoint.inspect import inspect
from calibrate.checkpoint.read import CheckpointScales
from calibrate.checkpoint.scale_check import LIE_FACTOR, MOST, UNCALIBRATED, check_scales
from calibrate.checkpoint.write import scales_file
from calibrate.cli import main
from calibrate.model.layers import ModelSignature
from calibrate.vllm_facts.loaders import LoadedScale

LAYERS = 3


@pytest.fixture(scope="module")
def out(tmp_path_factory, tokenizer, data_file):
    """A kvcal output of a tiny llama (3 layers, 2 KV heads), with its statistics."""
    root = tmp_path_factory.mktemp("lies")
    save_tiny_checkpoint(root / "model", "llama", tokenizer)
    api.calibrate(str(root / "model"), [str(data_file)], str(root / "out"), seq_len=64, max_tokens=256, verify=False, **QUIET)
    return root / "out"


def errors(found) -> list[str]:
    return [f"{p.layer}: {p.message}" for p in found.problems if p.severity == "error"]


def statistics_scale(out, kind: str, layer: int) -> float:
    """absmax / 448 of one layer and kind, read straight from the statistics file (kvcal's max observer, per tensor)."""
    return load_file(out / "kvcal" / "stats.safetensors")[f"{kind}.absmax"][layer].max().item() / 448


def test_an_untouched_output_passes(out):
    found = inspect(str(out))
    assert found.ok(strict=True), found.text()


def test_the_output_observer_is_held_to_the_range_of_its_candidates(out, tmp_path, data_file):
    """The output observer picks among other observers' scales on held-back data: its untouched output passes, and a
    scale 10× above the largest candidate (the max observer's) is named."""
    searched = tmp_path / "searched"
    api.calibrate(str(out.parent / "model"), [str(data_file)], str(searched), seq_len=64, max_tokens=256, verify=False,
                  observer="output", **QUIET)
    found = inspect(str(searched))
    assert found.ok(strict=True), found.text()
    tensors = load_file(scales_file(searched))
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([10 * statistics_scale(searched, "v", 0)])
    save_file(tensors, str(scales_file(searched)))
    (error,) = errors(inspect(str(searched)))
    assert error.startswith("0: model.layers.0.self_attn.v_scale") and "10× the " in error and "(output observer)" in error


def test_an_all_zero_export_fails_every_scale(out, tmp_path):
    """llm-compressor #2853: every k/v/q scale 0."""
    zero = edited_scales(out, tmp_path / "zero", lambda t: t.update({n: torch.zeros_like(v) for n, v in t.items()}))
    found = errors(inspect(str(zero)))
    assert len(found) == 3 * LAYERS
    assert all("is zero or negative (0); vLLM treats it as absent or fails" in m for m in found)
    assert main(["inspect", str(zero)]) == 1


def test_a_negative_scale_fails(out, tmp_path):
    negative = edited_scales(out, tmp_path / "neg", lambda t: t.update({"model.layers.1.self_attn.v_scale": torch.tensor([-0.5])}))
    assert errors(inspect(str(negative))) == ["1: model.layers.1.self_attn.v_scale is zero or negative (-0.5); vLLM treats "
                                             "it as absent or fails"]


def test_an_absurd_scale_is_named_as_changed_after_calibration(out, tmp_path):
    """k_scale 1e30 flushes every K of layer 1 to zero; the statistics say absmax / 448."""
    absurd = edited_scales(out, tmp_path / "absurd", lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor([1e30])}))
    expected = statistics_scale(out, "k", 1)
    found = errors(inspect(str(absurd)))
    assert len(found) == 1 and found[0].startswith("1: model.layers.1.self_attn.k_scale is 1e+30, ")
    assert f"{1e30 / expected:.3g}× the {expected:.3g} the checkpoint's kvcal statistics give" in found[0]
    assert "changed after calibration" in found[0]


@pytest.mark.parametrize("factor, flagged", [(0.9 * LIE_FACTOR, False), (1.1 * LIE_FACTOR, True),
                                             (1 / (0.9 * LIE_FACTOR), False), (1 / (1.1 * LIE_FACTOR), True)])
def test_the_factor_is_where_a_scale_stops_being_the_statistics(out, tmp_path, factor, flagged):
    scale = statistics_scale(out, "v", 2) * factor
    moved = edited_scales(out, tmp_path / "moved", lambda t: t.update({"model.layers.2.self_attn.v_scale": torch.tensor([scale])}))
    assert bool(errors(inspect(str(moved)))) == flagged


def test_an_all_one_modelopt_export_is_uncalibrated_not_an_error(out, tmp_path, capsys):
    """ModelOpt's fp8_cast: every k_proj.k_scale / v_proj.v_scale 1.0 under a ModelOpt config, and no statistics."""
    target = tmp_path / "modelopt"
    shutil.copytree(out, target)
    shutil.rmtree(target / "kvcal")
    renamed = {}
    for name, value in load_file(scales_file(target)).items():
        kind = name[-7]  # k, v or q; q keeps its generic name
        renamed[name.replace(f".{kind}_scale", f".{kind}_proj.{kind}_scale") if kind in "kv" else name] = torch.ones_like(value)
    save_file(renamed, str(scales_file(target)))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    (target / "config.json").write_text(json.dumps(config))
    found = inspect(str(target))
    assert found.producer == "ModelOpt" and found.ok(), found.text()
    assert [p.message for p in found.problems if p.severity == "warning"] == [UNCALIBRATED]
    assert [layer.scales["k"].tensor for layer in found.layers] == [f"model.layers.{i}.self_attn.k_proj.k_scale" for i in range(LAYERS)]
    assert main(["inspect", str(target)]) == 0 and UNCALIBRATED in capsys.readouterr().out
    assert main(["inspect", str(target), "--strict"]) == 1


def test_an_all_one_kvcal_output_says_what_its_statistics_give(out, tmp_path):
    ones = edited_scales(out, tmp_path / "ones", lambda t: t.update({n: torch.ones_like(v) for n, v in t.items()}))
    (warning,) = [p.message for p in inspect(str(ones)).problems if p.severity == "warning"]
    low = min(statistics_scale(out, "k", i) for i in range(LAYERS))
    assert warning.startswith(UNCALIBRATED) and f"k {low:.3g}–" in warning


def test_without_statistics_inspect_says_where_sizes_are_checked(out, tmp_path):
    """Inspect has no data to hold a scale to without statistics: the absurd scale is not an error here, and a note
    says so (verify's short sample catches it: tests/verification/test_run.py)."""
    bare = edited_scales(out, tmp_path / "bare", lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor([1e30])}),
                  statistics=False)
    found = inspect(str(bare))
    assert found.ok() and any("no kvcal statistics" in note for note in found.notes)


# ---- the short-sample rule, against FP8 round trips -----------------------------------------------------------------


def one_layer(k: torch.Tensor, scale: float) -> tuple[CheckpointScales, Stats]:
    """One layer whose K is ``k`` [1, 1, S, D] (v and q zero), holding k_scale ``scale``."""
    sig = ModelSignature("llama", [0], num_kv_heads=1, num_heads=1, head_dim=k.shape[-1])
    stats = Stats.empty(sig)
    stats.update(0, torch.zeros_like(k), k, torch.zeros_like(k), torch.arange(k.shape[2])[None])
    name = "model.layers.0.self_attn.k_scale"
    found = CheckpointScales({(0, "k"): [name]}, [], {(0, "k"): torch.tensor([scale])},
                             {0: {"k": LoadedScale([scale], name)}}, [])
    return found, stats


@pytest.mark.parametrize("small_share", [0.7, 0.3])
def test_a_scale_that_flushes_most_of_a_sample(small_share):
    """K: a share of values at 1e-3, the rest at ±10; scale 10 stores the small ones as FP8 zero."""
    g = torch.Generator().manual_seed(0)
    values = torch.where(torch.rand(1, 1, 100, 10, generator=g) < small_share, 1e-3, 10.0)
    k = values * torch.where(torch.rand(values.shape, generator=g) < 0.5, -1.0, 1.0)
    flushed = ((k / 10).to(torch.float8_e4m3fn).float() == 0).double().mean().item()  # the round trip vLLM's write does
    found, stats = one_layer(k, 10.0)
    findings = check_scales(found, sample=stats)
    assert bool(findings) == (flushed > MOST)
    if findings:
        assert findings[0].verdict == "flushes" and f"stores {flushed:.0%} of the K values of 100 held-out tokens" in findings[0].message


@pytest.mark.parametrize("large_share", [0.7, 0.3])
def test_a_scale_that_clips_most_of_a_sample(large_share):
    g = torch.Generator().manual_seed(1)
    k = torch.where(torch.rand(1, 1, 100, 10, generator=g) < large_share, 10.0, 1e-3)
    scale = 1e-3
    clipped = ((k / scale).abs() > 448).double().mean().item()  # beyond e4m3fn's largest value
    found, stats = one_layer(k, scale)
    findings = check_scales(found, sample=stats)
    assert bool(findings) == (clipped > MOST)
    if findings:
        assert findings[0].verdict == "clips" and f"saturates {clipped:.0%} of the K values" in findings[0].message
