"""choices.py: the one list of each name a user types, its refusals, and the check that tables keyed on it cover it."""

import pytest

from calibrate import choices
from calibrate.fp8 import FORMATS, WRITERS, get_format
from calibrate.scales.observers import parse_granularity, parse_observer
from calibrate.verification.kvdtypes import DTYPES


def test_the_tables_that_give_names_meaning_cover_exactly_the_names():
    assert tuple(FORMATS) == choices.FP8_FORMATS and tuple(DTYPES) == choices.CACHE_DTYPES
    assert tuple(WRITERS) == choices.BACKENDS
    # Every verify scheme that names a cache dtype is one kvcal emulates.
    cache_schemes = [name for name in choices.VERIFY_SCHEMES if name in DTYPES]
    assert cache_schemes and all(DTYPES[name].emulate is not None for name in cache_schemes)


@pytest.mark.parametrize("table", [{"a": 1}, {"a": 1, "b": 2, "c": 3}, {"b": 2, "a": 1}], ids=["missing", "extra", "reordered"])
def test_a_table_that_drifts_from_its_names_fails_at_import(table):
    with pytest.raises(RuntimeError, match="covers .* not choices'"):
        choices.check_table(table, ("a", "b"), "a table")
    choices.check_table({"a": 1, "b": 2}, ("a", "b"), "a table")  # exactly the names, in order: accepted


@pytest.mark.parametrize("text, message", [
    ("median", "unknown observer 'median'; choose one of: max, percentile:P, mse, sink-aware, output"),
    ("max:1", "unknown observer 'max:1'"),
    ("percentile:x", "write the percentile as a number"),
    ("percentile:0", "the percentile must be in (0, 100]"),
    ("percentile:100.5", "the percentile must be in (0, 100]"),
])
def test_an_unknown_observer_is_one_line_listing_the_choices(text, message):
    with pytest.raises(ValueError) as e:
        parse_observer(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_named_observer_parses_and_keeps_its_spelling():
    for text in ("max", "mse", "sink-aware", "output", "percentile:99.99", " mse "):
        assert str(parse_observer(text)) == text.strip()
    assert parse_observer("percentile:100").percentile == 100.0


def test_granularities_formats_schemes_and_forms_refuse_unknown_names_with_a_hint():
    for name in choices.GRANULARITIES:
        assert parse_granularity(name) == name
    with pytest.raises(ValueError, match="unknown granularity 'channel'; choose one of: tensor, head, token"):
        parse_granularity("channel")
    with pytest.raises(ValueError, match="unknown FP8 format 'e5m2'; choose one of: e4m3fn, e4m3fnuz"):
        get_format("e5m2")
    with pytest.raises(ValueError, match="unknown verify scheme 'nvfp5'; did you mean 'nvfp4'"):
        choices.check_verify_schemes(["tensor", "nvfp5"])
    with pytest.raises(ValueError, match="unknown export form 'modelop'; did you mean 'modelopt'"):
        choices.check_form_name("modelop")
    with pytest.raises(ValueError, match="--weights 'int4': choose fp8"):
        choices.check_weights("int4")
    choices.check_weights(None)
    with pytest.raises(ValueError, match="unknown backend 'rocm'; choose one of: cuda, triton, cpu"):
        choices.check_backend("rocm")
    for name in choices.BACKENDS:
        choices.check_backend(name)


@pytest.mark.parametrize("name, scheme", [
    ("auto", "bf16"), ("bfloat16", "bf16"), ("fp8", "tensor"), ("fp8_e4m3", "tensor"), ("fp8_per_token_head", "token"),
    ("int8_per_token_head", "int8_per_token_head"), ("nvfp4", "nvfp4"), ("fp8_e5m2", "fp8_e5m2"), ("scale1", "scale1"),
])
def test_vllm_cache_dtype_names_are_verify_schemes(name, scheme):
    """vLLM's --kv-cache-dtype names run as the scheme that stands for them (choices.VLLM_SCHEME_NAMES)."""
    assert choices.verify_scheme(name) == scheme


def test_every_cache_dtype_is_a_scheme_or_refused_as_not_emulated():
    """The table covers vLLM's names: each CACHE_DTYPES name runs, or is refused with "not emulated", never "unknown"."""
    for name in choices.CACHE_DTYPES:
        if name in choices.SCHEMES or name in choices.VLLM_SCHEME_NAMES:
            assert choices.verify_scheme(name) in choices.VERIFY_SCHEMES
            continue
        with pytest.raises(ValueError, match=f"^verify scheme '{name}': vLLM's --kv-cache-dtype {name} is not emulated by kvcal; choose from"):
            choices.verify_scheme(name)
    assert set(choices.VLLM_SCHEME_NAMES.values()) <= set(choices.VERIFY_SCHEMES)
    assert not set(choices.VLLM_SCHEME_NAMES) & set(choices.SCHEMES)  # one meaning per name


def test_verify_config_reads_vllm_names_as_kvcal_schemes():
    """A verify asked for fp8 and auto runs tensor and bf16 once each (the same scheme named twice runs once)."""
    from calibrate.verification.config import canonical_schemes

    assert canonical_schemes(["bf16", "auto", "fp8", "tensor", "fp8_per_token_head"]) == ["bf16", "tensor", "token"]


def test_the_scheme_table_agrees_with_the_cache_dtypes_it_names():
    """Each scheme's row (choices.SCHEMES) names an emulated --kv-cache-dtype whose scales it reads as that dtype does:
    computed per token where the dtype computes them, stored (1.0, the checkpoint's or an observer's) where it reads
    a per-tensor scale, none for the unquantized reference; ranks are distinct, a scales file's among them."""
    for name, spec in choices.SCHEMES.items():
        dtype = DTYPES[spec.kv_dtype]
        assert dtype.emulate is not None and spec.scales in choices.SCALE_SOURCES, name
        expected = {"token": {"computed"}, "tensor": {"ones", "checkpoint", "observer"}, "none": {"none"}}[dtype.scale]
        assert spec.scales in expected, name
        assert spec.label == spec.kv_dtype or spec.label.startswith((f"{spec.kv_dtype}, ", f"{spec.kv_dtype} (")), name  # vLLM's name first
    ranks = [spec.rank for spec in choices.SCHEMES.values()] + [choices.FILE_RANK]
    assert len(set(ranks)) == len(ranks)
    assert choices.scheme_label("my_scales") == "fp8, scales my_scales" and choices.scheme_label("token") == "fp8_per_token_head"
    # vLLM's names for a scheme and the scheme's own label agree on the dtype
    for vllm_name, scheme in choices.VLLM_SCHEME_NAMES.items():
        assert choices.SCHEMES[scheme].kv_dtype == {"bfloat16": "auto", "fp8_e4m3": "fp8"}.get(vllm_name, vllm_name)


def test_size_text_reads_back_with_parse_size():
    """The one formatter of byte counts in messages (no room, a --max-memory that holds no layer), and parse_size its
    reader: a user can paste the figure back as a flag."""
    from calibrate.choices import parse_size, size_text

    assert [size_text(n) for n in (512, 1536, 20 * 2**20, 3 * 2**30 + 2**29)] == ["512 B", "1.5 KiB", "20.0 MiB", "3.5 GiB"]
    for n in (1, 1023, 1024, 10**6, 7 * 2**30 + 12345):
        assert abs(parse_size(size_text(n).replace(",", "")) - n) <= 0.05 * 2 ** (10 * ((n.bit_length() - 1) // 10))


@pytest.mark.parametrize("typed, expected", [
    pytest.param("fp8, per head,fp8_per_token_head", ["head", "token"], id="a label with its comma"),
    pytest.param("fp8:scale1,fp8:tensor", ["scale1", "tensor"], id="typed forms"),
    pytest.param("fp8, calibrated per tensor", ["tensor"], id="a label alone"),
    pytest.param("tensor, head", ["tensor", "head"], id="internal names with a space"),
    pytest.param("fp8,auto", ["tensor", "bf16"], id="vLLM's names"),
])
def test_schemes_takes_every_label_as_printed(typed, expected):
    """--schemes takes the labels the tables print (choices.SCHEMES), their typed forms and kvcal's own names."""
    assert [choices.verify_scheme(name) for name in choices.split_schemes(typed)] == expected


def test_every_scheme_label_and_typed_form_reads_back():
    for name in choices.SCHEMES:
        assert choices.verify_scheme(choices.scheme_label(name)) == name
        assert choices.split_schemes(f"{choices.scheme_typed(name)},{choices.scheme_label(name)}") == [
            choices.scheme_typed(name), choices.scheme_label(name)]
