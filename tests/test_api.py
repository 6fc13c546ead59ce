"""Tests for calibrate/api.py and the result it returns (calibrate/result.py): the summary and provenance of a run,
and export re-deriving scales from saved statistics.

Expected values are computed here: scales as absmax / 448 in float64 from the statistics (or from the tensors
a hand-built ``Stats`` was fed), signatures from a model built from the same config, the written scales read
back from the checkpoint's safetensors shard.
"""

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from builders import kjv_jsonl, save_tiny_checkpoint
from safetensors.torch import load_file

import calibrate.api as api
from calibrate.capture.stats import SINK_POSITIONS, Stats
from calibrate.checkpoint.write import scales_file
from calibrate.fp8 import FORMATS, quantize, quantize_dequantize
from calibrate.model.description import describe, read_config
from calibrate.model.layers import AttentionLayer, ModelSignature
from calibrate.result import CalibrationResult
from calibrate.run.provenance import scale_report
from calibrate.scales.observers import derive_scales
from calibrate.vllm_facts.release import READ_IN
from calibrate.vllm_facts.serving import SERVE_NOTES

E4M3_MAX = 448.0


def as_json(value):
    """``value`` as it reads back from a JSON file (tuples become lists)."""
    return json.loads(json.dumps(value))


SIG = ModelSignature("llama", [0, 1, 2], num_kv_heads=2, num_heads=4, head_dim=8)
LAYERS = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in SIG.layers]


# ---------------------------------------------------------------------------------------------------------------
# The summary of hand-built results


def fed_stats(sink_value: float | None = None, seq_len: int = 64) -> tuple[Stats, dict[str, torch.Tensor]]:
    """Statistics of random Q, K, V in [-1, 1] ([L, B=1, H, S, D] per kind), every layer fed once.

    With ``sink_value``, K holds that value at the first SINK_POSITIONS positions (attention-sink-like outliers).
    """
    g = torch.Generator().manual_seed(0)
    heads = {"q": SIG.num_heads, "k": SIG.num_kv_heads, "v": SIG.num_kv_heads}
    raw = {kind: torch.rand(len(SIG.layers), 1, h, seq_len, SIG.head_dim, generator=g) * 2 - 1 for kind, h in heads.items()}
    if sink_value is not None:
        raw["k"][:, :, :, :SINK_POSITIONS] = sink_value
    stats = Stats.empty(SIG)
    for row in range(len(SIG.layers)):
        stats.update(row, raw["q"][row], raw["k"][row], raw["v"][row], torch.arange(seq_len)[None])
    return stats, raw


def table_rows(summary: str, n: int) -> list[list[float]]:
    header, rule, *rows = summary.splitlines()[: 2 + n]
    assert header.split()[:3] == ["layer", "k", "absmax"] and set(rule) == {"-"}
    return [[float(c) for c in row.split()] for row in rows]


@pytest.mark.parametrize("granularity, sliding", [("tensor", False), ("head", True), ("token", False)])
def test_summary_shows_each_layer_and_the_serve_command(granularity, sliding):
    stats, raw = fed_stats()
    layers = [AttentionLayer(i, f"model.layers.{i}.self_attn", sliding and i % 2 == 0) for i in SIG.layers]
    scale_set = derive_scales(stats.kinds, observer="max", granularity=granularity, fmt=FORMATS["e4m3fn"])
    text = CalibrationResult(Path("/models/out"), layers, stats, scale_set, {}).summary(verbose=True)
    lines = text.splitlines()

    for layer, cells in zip(layers, table_rows(text, len(layers))):
        assert cells[0] == layer.layer_idx
        for j, kind in enumerate(("k", "v", "q")):
            top = raw[kind][layer.layer_idx].abs().max().double().item()  # max over heads: the table's value
            assert cells[1 + 3 * j] == pytest.approx(top, rel=1e-3)
            assert cells[2 + 3 * j] == pytest.approx(top / E4M3_MAX, rel=1e-3)
            assert cells[3 + 3 * j] == 0.0  # the max observer saturates nothing it saw
    assert f"observer max, granularity {granularity}, format e4m3fn, 64 tokens per layer" in lines
    assert SERVE_NOTES[granularity] in lines
    assert "wrote /models/out" in lines
    dtype = "fp8_per_token_head" if granularity == "token" else "fp8"
    backend = " --attention-backend FLASH_ATTN" if granularity == "head" else ""
    serve = lines.index("serve it with:")
    assert lines[serve + 1] == f"  vllm serve /models/out --kv-cache-dtype {dtype}{backend}"
    hint = [line for line in lines if "--kv-cache-dtype-skip-layers sliding_window" in line]
    assert len(hint) == (1 if sliding else 0)


@pytest.mark.smoke
def test_max_observer_scales_saturate_nothing_they_saw():
    """The max observer's promise (recipes/default.yaml): nothing seen in calibration saturates, sinks included.

    A float32 scale can land one step below absmax / 448; absmax then divides to a hair above 448 and is stored as
    448 by rounding, not clipped: its round trip errs by no more than any value's at the top of the range."""
    stats, _ = fed_stats()
    scale_set = derive_scales(stats.kinds, observer="max", granularity="tensor", fmt=FORMATS["e4m3fn"])
    for kind, scales in scale_set.scales.items():
        absmax = stats.kinds[kind].absmax.amax(1)  # [L]
        assert (quantize(absmax, scales) == E4M3_MAX).all(), kind  # the largest value seen is the largest code
        back = quantize_dequantize(absmax, scales).double()
        assert ((back - absmax.double()).abs() <= absmax.double() * 2.0**-4).all(), kind  # e4m3's half step at the top
        assert (scale_set.predictions[kind].saturated == 0).all() and (scale_set.sink_saturated[kind] == 0).all(), kind
    lines = CalibrationResult(Path("o"), LAYERS, stats, scale_set, {}).summary().splitlines()
    assert not any(line.startswith("sink tokens") for line in lines)


@pytest.mark.parametrize("tokens, little", [(None, True), (100_000, False)], ids=["64-tokens", "100k-tokens"])
def test_summary_says_when_scales_rest_on_little_data(tokens, little):
    stats, _ = fed_stats()
    if tokens is not None:
        stats.tokens[:] = tokens
    scale_set = derive_scales(stats.kinds, observer="max", granularity="tensor", fmt=FORMATS["e4m3fn"])
    lines = CalibrationResult(Path("o"), LAYERS, stats, scale_set, {}).summary(verbose=True).splitlines()
    notes = [line for line in lines if line.startswith("scales rest on little data")]
    assert notes == (["scales rest on little data: 64 tokens per layer (< 100,000); rarer outliers were likely not seen: "
                      "calibrate on more data (--max-tokens) or add --headroom before serving"] if little else [])


def test_summary_reports_saturated_sink_tokens_of_the_sink_aware_observer():
    """K's first positions hold 20, the rest at most 1: sink-aware scales from the rest saturate every sink value."""
    stats, raw = fed_stats(sink_value=20.0)
    scale_set = derive_scales(stats.kinds, observer="sink-aware", granularity="tensor", fmt=FORMATS["e4m3fn"])
    text = CalibrationResult(Path("o"), LAYERS, stats, scale_set, {}).summary(verbose=True)
    for layer, cells in zip(LAYERS, table_rows(text, len(LAYERS))):
        later = raw["k"][layer.layer_idx][:, :, SINK_POSITIONS:].abs().max().double().item()
        assert cells[1] == pytest.approx(20.0) and cells[2] == pytest.approx(later / E4M3_MAX, rel=1e-3)
    (note,) = [line for line in text.splitlines() if line.startswith("sink tokens (first positions) saturated, worst layer: ")]
    kinds = dict(part.split(" ") for part in note.split(": ", 1)[1].split(", "))
    assert float(kinds["k"].rstrip("%")) == pytest.approx(100.0)


# ---------------------------------------------------------------------------------------------------------------
# A real calibration of a tiny model, and export from its statistics


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, smol_tokenizer):
    """A tiny llama calibrated on real text (512 tokens), with the CalibrationConfig the run was given."""
    root = tmp_path_factory.mktemp("api")
    model = save_tiny_checkpoint(root / "tiny", "llama", smol_tokenizer)
    data = kjv_jsonl(root / "data.jsonl", 200)
    configs, run = [], api.run_calibration

    def spy(config):
        configs.append(config)
        return run(config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "run_calibration", spy)
        result = api.calibrate(str(model), [str(data)], str(root / "out"), seq_len=64, max_tokens=512, verify=False,
                               progress=False, device="cpu")
    (config,) = configs
    return SimpleNamespace(model=model, data=data, out=root / "out", result=result, config=config)


def test_summary_of_a_real_calibration_matches_the_written_scales(calibrated):
    r, out = calibrated.result, calibrated.out
    written = load_file(scales_file(out))
    text = r.summary()
    for layer, cells in zip(r.layers, table_rows(text, len(r.layers))):
        assert cells[0] == layer.layer_idx
        for j, kind in enumerate(("k", "v", "q")):
            stored = written[f"{layer.prefix}.{kind}_scale"].item()
            assert cells[2 + 3 * j] == pytest.approx(stored, rel=1e-3)
            assert cells[1 + 3 * j] == pytest.approx(E4M3_MAX * stored, rel=1e-3)
    lines = text.splitlines()
    assert "observer max, granularity tensor, format e4m3fn, 512 tokens per layer" in lines
    assert any(line.startswith("scales rest on little data: 512 tokens per layer") for line in lines)
    assert f"wrote {out}" in lines
    assert lines[-2:] == ["serve it with:", f"  vllm serve {out} --kv-cache-dtype fp8"]
    # No GPU engine has run fp8 (vllm_facts.caveats: no measured row on target gpu), and the summary says so before the line.
    assert lines[-3].startswith("scales rest on little data") and lines[-3].endswith("more with --verbose)")
    assert r.summary(verbose=True).splitlines()[-3].startswith(f"note: Not run in vLLM {READ_IN}'s engine by kvcal: fp8 on target gpu")


def test_provenance_holds_the_runs_settings_and_scales(calibrated):
    r, out = calibrated.result, calibrated.out
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert provenance == as_json(r.provenance)
    assert provenance["settings"] == as_json(calibrated.config.settings())
    given = {"data": [str(calibrated.data)], "seq_len": 64, "max_tokens": 512, "device": "cpu", "verify": False, "progress": False}
    assert {k: provenance["settings"][k] for k in given} == given
    assert provenance["scales"] == as_json(scale_report(r.scale_set))

    # The scales themselves, from the saved statistics: absmax over heads / 448, in float64, stored as float32.
    stats = Stats.load(out / "kvcal" / "stats.safetensors")
    written = load_file(scales_file(out))
    for kind in ("k", "v", "q"):
        expected = (stats.kinds[kind].absmax.amax(1).double() / E4M3_MAX).float().tolist()
        assert provenance["scales"]["scales"][kind] == expected
        assert provenance["scales"]["checkpoint_scales"][kind] == expected  # e4m3fn: vLLM uses the stored value
        assert [written[f"{layer.prefix}.{kind}_scale"].item() for layer in r.layers] == expected
    assert provenance["layers"] == [{"layer_idx": i, "prefix": f"model.layers.{i}.self_attn", "sliding_window": False} for i in range(3)]
    assert provenance["signature"] == asdict(describe(calibrated.model).signature([0, 1, 2]))
    assert provenance["tokens"] == 512 and provenance["little_data"] is True
    assert provenance["model"] == str(calibrated.model.resolve())
    assert provenance["base_model"] is None and provenance["hub_id"] is None  # a local model, nothing named


def test_export_names_the_card_s_base_model_and_repo_or_keeps_the_calibration_s(calibrated, tmp_path):
    """--base-model/--hub-id on export land in the provenance the card reads; without them the base model is the
    calibration's and the repo unnamed (a new output is a new upload)."""
    named = api.export(str(calibrated.out), str(tmp_path / "named"), base_model="org/base@v2", hub_id="me/named")
    assert named.provenance["base_model"] == {"id": "org/base", "revision": "v2"} and named.provenance["hub_id"] == "me/named"
    again = api.export(str(tmp_path / "named"), str(tmp_path / "again"))
    assert again.provenance["base_model"] == {"id": "org/base", "revision": "v2"} and again.provenance["hub_id"] is None


def test_export_rederives_exactly_the_calibrated_scales(calibrated, tmp_path):
    r, out = calibrated.result, calibrated.out
    again = api.export(str(out), str(tmp_path / "again"))
    before, after = load_file(scales_file(out)), load_file(scales_file(tmp_path / "again"))
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert all(torch.equal(again.scale_set.scales[k], r.scale_set.scales[k]) for k in r.scale_set.scales)
    provenance = json.loads((tmp_path / "again" / "kvcal" / "calibration.json").read_text())
    assert provenance["exported_from"] == str(out.resolve())
    assert provenance["settings"] == r.provenance["settings"]  # the calibration's own, carried forward
    assert provenance["scales"] == as_json(scale_report(again.scale_set))


@pytest.mark.parametrize("observer", ["percentile:99.9", "mse", "sink-aware"])
def test_other_observers_give_scales_no_larger_than_max(calibrated, tmp_path, observer):
    """Every other observer clips (or ignores) the largest values the max observer keeps."""
    exported = api.export(str(calibrated.out), str(tmp_path / "o"), observer=observer)
    for kind, max_scales in calibrated.result.scale_set.scales.items():
        got = exported.scale_set.scales[kind]
        assert got.shape == max_scales.shape and (got > 0).all() and (got <= max_scales).all(), kind
    assert exported.provenance["scales"]["observer"] == observer


def test_export_headroom_and_per_head_scales(calibrated, tmp_path):
    r = calibrated.result
    doubled = api.export(str(calibrated.out), str(tmp_path / "doubled"), headroom=2.0)
    assert all(torch.equal(doubled.scale_set.scales[k], 2 * r.scale_set.scales[k]) for k in r.scale_set.scales)

    head = api.export(str(calibrated.out), str(tmp_path / "head"), granularity="head")
    written = load_file(scales_file(tmp_path / "head"))
    for kind in ("k", "v", "q"):
        expected = (r.stats.kinds[kind].absmax.double() / E4M3_MAX).float()  # [L, H]
        assert torch.equal(head.scale_set.scales[kind], expected)
        assert torch.equal(expected.amax(1), r.scale_set.scales[kind])  # per tensor is the max over heads
        for row, layer in enumerate(r.layers):
            assert torch.equal(written[f"{layer.prefix}.{kind}_scale"].flatten(), expected[row])


def test_export_names_a_target_config_key_it_needs(calibrated, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    config = read_config(calibrated.model)
    del config["num_attention_heads"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"target/config.json has no 'num_attention_heads'"):
        api.export(str(calibrated.out), str(tmp_path / "o"), model=str(target))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 0, "has num_attention_heads 0, not a positive integer; fix config.json"),
    ("architectures", ["BertForMaskedLM"], "holds a BertForMaskedLM; kvcal calibrates the decoders vLLM serves"),
])
def test_apply_refuses_a_target_config_as_every_command_does(calibrated, tmp_path, field, value, message):
    """apply reads the target's config.json once and still gives read_config's refusals, in its words, before any
    arithmetic on a zero head count."""
    target = tmp_path / "target"
    shutil.copytree(calibrated.model, target)
    config = json.loads((target / "config.json").read_text())
    config[field] = value
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        api.apply(str(calibrated.out), str(target), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_summary_of_many_layers_shows_the_ones_that_matter_and_counts_the_rest(monkeypatch):
    """Past TOP_LAYERS + 1 layers the table shows the TOP_LAYERS most saturated, then the largest absmax against the
    median layer's; --verbose (and calibration.json) keep every layer."""
    from calibrate import result

    stats, _ = fed_stats()
    stats.kinds["v"].absmax[1] *= 50  # layer 1's V: an outlier among the three
    scale_set = derive_scales(stats.kinds, observer="max", granularity="tensor", fmt=FORMATS["e4m3fn"])
    monkeypatch.setattr(result, "TOP_LAYERS", 1)
    lines = CalibrationResult(Path("o"), LAYERS, stats, scale_set, {}).summary().splitlines()
    assert [row[0] for row in table_rows("\n".join(lines), 1)] == [1]
    assert lines[3].startswith("... 2 more layers")
    verbose = CalibrationResult(Path("o"), LAYERS, stats, scale_set, {}).summary(verbose=True)
    assert [row[0] for row in table_rows(verbose, 3)] == [0, 1, 2]
