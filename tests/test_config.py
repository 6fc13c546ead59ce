"""Tests for ``calibrate/config.py``: the configuration tree, one definition and one rule per setting."""

import json
import subprocess
import sys
from dataclasses import asdict, fields

import pytest

from calibrate import recipes
from calibrate.choices import WEIGHT_SCHEMES, check_form_name, check_verify_schemes
from calibrate.config import CalibrationConfig, ScaleConfig, parse_max_memory
from calibrate.data.config import DataConfig
from calibrate.settings import flat_settings, route_options
from calibrate.thresholds import Thresholds
from calibrate.verification.config import VerifyConfig


def test_route_options_sends_each_name_to_its_owner():
    parts, rest = route_options({"seq_len": 64, "observer": "mse", "max_kl": 0.5, "device": "cpu"},
                                {"data": DataConfig, "scales": ScaleConfig, "thresholds": Thresholds})
    assert parts == {"data": {"seq_len": 64}, "scales": {"observer": "mse"}, "thresholds": {"max_kl": 0.5}}
    assert rest == {"device": "cpu"}


def test_part_field_names_are_unique_across_the_tree():
    """A flat option must have one owner: no field name appears in two parts or in a part and its config."""
    for owner in (CalibrationConfig, VerifyConfig):
        names = [f.name for part in owner.PARTS.values() for f in fields(part)]
        own = [f.name for f in fields(owner) if f.name not in owner.PARTS]
        assert len(names) == len(set(names)) and not set(names) & set(own), owner.__name__


def test_calibration_settings_are_the_flat_layout_calibration_json_always_had(tmp_path):
    config = CalibrationConfig(model=str(tmp_path), data=["a.txt"], out="o", scales=ScaleConfig(observer="mse"))
    settings = config.settings()
    assert list(settings) == ["data", *CalibrationConfig.SETTINGS[1:]]
    # Every value is the one in the tree (the sources under "data", as before the tree).
    assert settings["data"] == ["a.txt"] and settings["observer"] == "mse" and settings["seq_len"] == config.data.seq_len
    assert json.loads(json.dumps(settings)) == settings


@pytest.mark.smoke
def test_verify_settings_and_defaults():
    config = VerifyConfig.from_options("ckpt", "d.txt", seq_len=128, max_kl=0.5, fa3=True)
    assert (config.data.seq_len, config.data.max_tokens, config.thresholds.max_kl, config.fa3) == (128, 4096, 0.5, True)
    assert list(config.settings()) == VerifyConfig.SETTINGS
    defaults = VerifyConfig.defaults()
    assert {k: defaults[k] for k in VerifyConfig.SAMPLE} == VerifyConfig.SAMPLE
    assert {k: defaults[k] for k in ("max_kl", "fail_kl", "min_top1", "fail_top1", "floor_pass", "floor_fail")} == asdict(Thresholds())
    with pytest.raises(ValueError, match="unknown verify option 'seqlen'"):
        VerifyConfig.from_options("ckpt", "d.txt", seqlen=128)


def test_flat_settings_inlines_parts_in_the_order_asked():
    config = VerifyConfig("ckpt", ["d.txt"])
    # kv_only is None until validate() (False) or the engine's platform (VerifyConfig.match_engine) settles it.
    assert flat_settings(config, ["floor_fail", "seed", "kv_only"]) == {"floor_fail": 100.0, "seed": 0, "kv_only": None}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"seq_len": 1}, "--seq-len must be an integer ≥ 2, got 1"),
        ({"seq_len": 2.5}, "--seq-len must be an integer ≥ 2"),
        ({"max_tokens": True}, "--max-tokens must be a positive integer"),
        ({"chunk_len": 0}, "--chunk-len must be a positive integer"),
        ({"pack": "yes"}, "pack must be True or False"),
        ({"seed": 1.0}, "seed must be an integer"),
    ],
    ids=["seq-len-1", "seq-len-float", "max-tokens-bool", "chunk-len-0", "pack-str", "seed-float"],
)
def test_data_rules_are_the_same_for_calibrate_verify_and_recipes(tmp_path, options, message):
    """One rule per setting: the same value is refused with the same words by every way in."""
    with pytest.raises(ValueError, match=message):
        DataConfig(sources=[], **options).check_values()
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(model=str(tmp_path), data=DataConfig([str(tmp_path / "x.txt")], **options), out="o").validate()
    with pytest.raises(ValueError, match=message):
        VerifyConfig.from_options(str(tmp_path), [str(tmp_path / "x.txt")], **options).data.check_values()
    if all(type(v) is int for v in options.values()):  # a recipe's types are checked first: ints reach the rule
        (tmp_path / "r.yaml").write_text("data:\n" + "".join(f"  {k}: {v}\n" for k, v in options.items()))
        with pytest.raises(ValueError, match=message):
            recipes.load_recipe(str(tmp_path / "r.yaml"))


@pytest.mark.parametrize(
    "scales, message",
    [
        ({"observer": "maximum"}, "unknown observer 'maximum'"),
        ({"observer": "percentile:101"}, r"the percentile must be in \(0, 100\]"),
        ({"granularity": "channel"}, "unknown granularity 'channel'"),
        ({"headroom": 0.9}, "--headroom must be a number ≥ 1.0"),
        ({"headroom": float("inf")}, "--headroom must be a number ≥ 1.0"),
        ({"query_scale": 1}, "query_scale must be True or False"),
        ({"fp8_format": "e5m2"}, "unknown FP8 format 'e5m2'"),
    ],
)
def test_scale_rules(scales, message):
    with pytest.raises(ValueError, match=message):
        ScaleConfig(**scales).validate()


@pytest.mark.parametrize(
    "limits",
    [{"max_kl": -1.0}, {"max_kl": 0.5, "fail_kl": 0.1}, {"min_top1": 0.8, "fail_top1": 0.9}, {"min_top1": 1.5}],
)
def test_thresholds_must_be_ordered(limits):
    with pytest.raises(ValueError, match="thresholds must satisfy"):
        Thresholds(**limits).validate()
    with pytest.raises(ValueError, match="threshold max_kl must be a number"):
        Thresholds(max_kl="low").validate()


def test_names_outside_the_tables_are_refused_with_the_nearest():
    with pytest.raises(ValueError, match="did you mean 'modelopt'"):
        check_form_name("modelop")
    with pytest.raises(ValueError, match="did you mean 'tensor'"):
        check_verify_schemes(["tensr"])


def test_max_memory_parses_devices_and_units():
    assert parse_max_memory("0=70GiB, cpu=1.5GB,disk=10MB") == {0: 70 * 2**30, "cpu": 1_500_000_000, "disk": 10_000_000}
    assert parse_max_memory({"cuda:1": 1024}) == {1: 1024}
    for bad, message in [("0=70", "not a size"), ("gpu=1GB", "not a device"), ("0=1GB,cuda:0=2GB", "twice")]:
        with pytest.raises(ValueError, match=message):
            parse_max_memory(bad)


def test_weight_scheme_names_are_the_ones_weights_py_applies():
    from calibrate.checkpoint import weights

    assert set(WEIGHT_SCHEMES) == set(weights.SCHEMES) == set(weights.PROVENANCE)


def test_recipe_thresholds_are_checked_together(tmp_path):
    """A recipe may raise max_kl above the default fail_kl: an unset limit follows a set one, two set ones must agree."""
    (tmp_path / "r.yaml").write_text("verify:\n  thresholds:\n    max_kl: 0.2\n    fail_kl: 0.5\n")
    assert recipes.load_recipe(str(tmp_path / "r.yaml"))["verify"]["thresholds"] == {"max_kl": 0.2, "fail_kl": 0.5}
    (tmp_path / "r.yaml").write_text("verify:\n  thresholds:\n    max_kl: 0.2\n")
    assert Thresholds(max_kl=0.2).validate().resolve(None).fail_kl == 0.2
    (tmp_path / "r.yaml").write_text("verify:\n  thresholds:\n    max_kl: 0.2\n    fail_kl: 0.1\n")
    with pytest.raises(ValueError, match="verify.thresholds: thresholds must satisfy"):
        recipes.load_recipe(str(tmp_path / "r.yaml"))


def test_limits_follow_the_floor_unless_set():
    floor = {"kl": 0.002, "top1": 0.99}  # 1% of top-1 choices already differ in the floor
    limits = Thresholds(floor_pass=5, floor_fail=50).resolve(floor)
    assert (limits.max_kl, limits.fail_kl) == pytest.approx((0.01, 0.1))
    # Top-1 disagreement grows with the square root of KL: 0.99 to the power √5 and √50 (about 1 − √5 × 1%, 1 − √50 × 1%).
    assert (limits.min_top1, limits.fail_top1) == pytest.approx((0.99 ** 5**0.5, 0.99 ** 50**0.5))
    assert limits.min_top1 == pytest.approx(1 - 5**0.5 * 0.01, abs=3e-4)
    # A 30% disagreement at 100×: the old 1 − 100 × miss was 0 (nothing could fail); the power stays above 0.
    assert 0 < Thresholds().resolve({"kl": 0.002, "top1": 0.7}).fail_top1 == pytest.approx(0.7**10)
    limits = Thresholds(max_kl=0.5, min_top1=0.999).resolve(floor)
    assert (limits.max_kl, limits.fail_kl, limits.min_top1) == (0.5, 0.5, 0.999)  # the derived fail_kl (0.2) follows the set max_kl
    assert Thresholds(max_kl=0.5).origin() == {"max_kl": "set", "fail_kl": "floor", "min_top1": "floor", "fail_top1": "floor"}
    assert vars(Thresholds().resolve(None)) == {**Thresholds.ABSOLUTE, "floor_pass": 10.0, "floor_fail": 100.0}
    for ratios in ({"floor_pass": 0.5}, {"floor_pass": 20, "floor_fail": 10}):
        with pytest.raises(ValueError, match="1 ≤ floor-pass ≤ floor-fail"):
            Thresholds(**ratios).validate()


def test_config_imports_neither_torch_nor_transformers():
    """The CLI checks settings with this module before any heavy import (data/config.py too, which it holds a part of)."""
    code = "import sys, calibrate.config; print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    assert out.strip() == "[]"


def test_the_headroom_limit_is_where_the_largest_value_seen_would_become_subnormal():
    """MAX_HEADROOM (torch-free, in choices) is the smallest ratio of a format's largest value to its smallest normal one."""
    from calibrate.choices import MAX_HEADROOM
    from calibrate.fp8 import FORMATS

    assert MAX_HEADROOM == min(f.max / f.min_normal for f in FORMATS.values()) == 448 * 2**6


def test_the_short_verify_compares_the_same_schemes_from_python_and_from_the_default_recipe(tmp_path, text_file):
    """``run_calibration(CalibrationConfig(...))`` and ``calibrate()``/the CLI (the default recipe) verify alike."""
    from calibrate.recipes import calibration_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    plain = CalibrationConfig(model=str(model), out=str(tmp_path / "out"), data=[str(text_file)])
    recipe = calibration_config(recipe=None, model=str(model), out=str(tmp_path / "out"), data=[str(text_file)])
    assert plain.written_schemes() == recipe.written_schemes() == ["scale1", "tensor", "token", "int8_per_token_head"]
    per_head = calibration_config(recipe=None, model=str(model), out=str(tmp_path / "o"), data=[str(text_file)], granularity="head")
    assert per_head.written_schemes() == ["scale1", "head", "token", "int8_per_token_head"]


def test_the_output_observers_granularity_is_checked_with_the_settings():
    """Before any model loads, in the one wording scales/search.py uses too (choices.check_output_granularity)."""
    with pytest.raises(ValueError, match="the output observer picks static scales: use --granularity tensor or head, not token"):
        ScaleConfig(observer="output", granularity="token").validate()
    for granularity in ("tensor", "head"):
        ScaleConfig(observer="output", granularity=granularity).validate()
    ScaleConfig(observer="max", granularity="token").validate()  # the rule is the output observer's alone
